"""Code that runs on a worker: the in-graph worker loop and one replica's step (loss, gradients, state deltas)."""
