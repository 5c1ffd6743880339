"""Code that runs on the ps: the sync-replicas aggregator, the step gate, the apply loop and the clipped update."""
