"""The sync-replicas aggregator in one process: real TF servers (2 workers, 1 ps) started in-process,
pushes made by closures that ClusterCoordinator runs on the workers, takes made by the chief.

Fast (seconds): the heart of pstrain without launching processes.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import tensorflow as tf

from chief.aggregator import SyncReplicasAggregator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def coordinator():
    cluster = {"worker": [f"127.0.0.1:{free_port()}" for _ in range(2)], "ps": [f"127.0.0.1:{free_port()}"]}
    spec = tf.train.ClusterSpec(cluster)
    # In-process servers cannot be stopped; they live as long as the test process, like TF's own tests.
    servers = [
        tf.distribute.Server(spec, job_name=job, task_index=i, start=True) for job in cluster for i in range(len(cluster[job]))
    ]
    strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc"))
    yield strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)
    del servers


def make(coordinator, required: int, total: int, start_step: int):
    """A 2-element variable on the ps, its aggregator, and push/take functions as the engines use them."""
    strategy, coord = coordinator
    with strategy.scope():
        variable = tf.Variable([0.0, 0.0])
    aggregator = SyncReplicasAggregator([variable], required=required, total_slots=total, start_step=start_step)

    @tf.function
    def push_fn(slot, step, gradient):
        aggregator.push(slot, step, [gradient])
        return tf.constant(1)

    def push(slot: int, step: int, gradient: list[float]) -> None:
        # A scheduled closure, run on whichever worker ClusterCoordinator picks, as in a real step.
        coord.schedule(push_fn, args=(slot, tf.constant(step, tf.int64), tf.constant(gradient))).fetch()

    take_fn = tf.function(lambda step, chosen: aggregator.take_mean(step, chosen))

    def take(step: int, chosen: list[bool]) -> np.ndarray:
        return take_fn(tf.constant(step, tf.int64), tf.constant(chosen))[0].numpy()

    assert "/job:ps/" in variable.device
    return push, take


def test_mean_of_the_step_is_exact_and_a_late_gradient_is_dropped(coordinator):
    push, take = make(coordinator, required=2, total=2, start_step=5)
    push(0, 5, [1.0, 2.0])
    push(1, 4, [100.0, 100.0])  # a straggler of step 4: the accumulator is at step 5, so it is dropped
    push(1, 5, [3.0, 6.0])
    np.testing.assert_array_equal(take(5, [True, True]), [2.0, 4.0])
    push(0, 5, [100.0, 100.0])  # step 5 is over: a late push for it is dropped too
    push(0, 6, [0.0, 2.0])
    push(1, 6, [4.0, 4.0])
    np.testing.assert_array_equal(take(6, [True, True]), [2.0, 3.0])


def test_a_rerun_closure_counts_once(coordinator):
    """ClusterCoordinator may run a closure twice; the same gradient pushed twice into one slot is that gradient."""
    push, take = make(coordinator, required=2, total=2, start_step=0)
    push(0, 0, [2.0, 2.0])
    push(0, 0, [2.0, 2.0])
    push(1, 0, [4.0, 0.0])
    np.testing.assert_array_equal(take(0, [True, True]), [3.0, 1.0])


def test_backup_slot_is_dropped_and_leaves_no_trace(coordinator):
    """3 slots, 2 required: the unchosen slot's gradient is flushed, not carried into the next step."""
    push, take = make(coordinator, required=2, total=3, start_step=0)
    push(0, 0, [1.0, 1.0])
    push(2, 0, [50.0, 50.0])  # arrived, but the chief chose slots 0 and 1
    push(1, 0, [3.0, 3.0])
    np.testing.assert_array_equal(take(0, [True, True, False]), [2.0, 2.0])
    push(2, 1, [4.0, 0.0])
    push(0, 1, [0.0, 4.0])
    np.testing.assert_array_equal(take(1, [True, False, True]), [2.0, 2.0])  # not mean(50, 4)
