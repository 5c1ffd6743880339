"""The engines that run steps from the chief: the cluster dispatch, the standalone engine, the positions
each closure reads, and the block results."""
