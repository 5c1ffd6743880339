"""The chief: ClusterCoordinator driver, sync-replicas aggregator, training loop, checkpoints."""
