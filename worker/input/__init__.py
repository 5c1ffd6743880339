"""The examples a worker reads for a (step, slot): tables, tf.data datasets, streams, and the read-ahead."""
