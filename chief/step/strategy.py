"""ParameterServerStrategy whose ps tasks see each other, so the apply loop runs on one ps.

TF's strategy gives each ps a device filter of the workers and the chief only (a ps sees no other ps,
`parameter_server_strategy_v2.py` `_connect_to_cluster`). A function that updates variables on several
ps then has to run on the chief, and its in-graph loop's every step crosses to the chief and back: on
2 ps, about 5 ms of the chief's CPU a step where one ps costs it 0.5 (chief.jobs.digits, 1 worker). Here
each ps also sees the other ps, so the chief calls the loop once per block on the global step's ps,
which drives the other ps's part itself. The workers' filters are TF's: a worker sees no other worker,
which keeps a worker's failure from reaching the others' contexts. A ps's failure ends every block
either way (the chief restarts the cluster's state from the last checkpoint)."""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.eager import remote


class PeeredPSStrategy(tf.distribute.ParameterServerStrategy):
    """tf.distribute.ParameterServerStrategy with "/job:ps" added to every ps's device filters.

    It must be the first strategy a process connects with: TF keeps the filters of a process's first
    connect for good (a later connect, and ClusterCoordinator's reconnect after a lost worker, update
    the cluster but not the filters), so a plain ParameterServerStrategy connected earlier leaves the
    ps blind to each other and the apply loop fails with "/job:ps/.../CPU:0 unknown device"."""

    def _connect_to_cluster(self, coordinator_name: str) -> None:
        connect_to_cluster = remote.connect_to_cluster

        def peered(cluster_spec, *args, cluster_device_filters=None, **kwargs):
            for task in range(cluster_spec.num_tasks("ps")):
                visible = ["/job:worker", "/job:ps", f"/job:{coordinator_name}"]
                cluster_device_filters.set_device_filters("ps", task, visible)
            return connect_to_cluster(cluster_spec, *args, cluster_device_filters=cluster_device_filters, **kwargs)

        # TF's method builds the filters and connects in one body: its call to connect is wrapped, for its duration.
        remote.connect_to_cluster = peered
        try:
            super()._connect_to_cluster(coordinator_name)
        finally:
            remote.connect_to_cluster = connect_to_cluster
