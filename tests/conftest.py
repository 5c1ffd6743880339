"""Shared fixtures."""

from __future__ import annotations

import socket

import pytest

_given: set[int] = set()  # every port _free_port returned in this session


def _free_port() -> int:
    """A port free on 127.0.0.1 now and never returned before in this session (OSError when none is left).

    A port already handed out is kept bound while asking again, so the kernel must pick another.
    """
    held: list[socket.socket] = []
    try:
        while True:
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
    finally:
        for s in held:
            s.close()


@pytest.fixture(scope="session")
def in_process_cluster():
    """A resolver for 2 workers and 2 ps as real TF servers inside the test process (no subprocesses).

    In-process servers cannot be stopped; they live as long as the test process, as in TF's own
    tests. They share the process, so each gets a large inter-op pool: the ps kernels that wait for
    gradients would otherwise starve the 2-core default and hang the step.
    """
    import tensorflow as tf

    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)], "ps": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    spec = tf.train.ClusterSpec(cluster)
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=16)
    servers = [
        tf.distribute.Server(spec, job_name=job, task_index=i, config=config) for job in cluster for i in range(len(cluster[job]))
    ]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
    tf.distribute.ParameterServerStrategy(resolver)  # connect this process first: later local variables live beside it
    yield resolver
    del servers
