"""The step math and its executors: one replica's gradients, the aggregator on the ps, the engines that run steps."""
