"""Model state: the variables, where they live (shards), their initial values and checkpoints."""
