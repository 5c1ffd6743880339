"""The sync-replicas aggregator in one process: real TF servers (2 workers, 2 ps) started in-process,
pushes made by closures that ClusterCoordinator runs on the workers, takes made by the chief.

Fast (seconds): the heart of pstrain without launching processes.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from chief.step.strategy import PeeredPSStrategy
from worker.ps.aggregator import SyncReplicasAggregator
from worker.replica.gradients import unique_rows

pytestmark = pytest.mark.inprocess


@pytest.fixture(scope="module")
def coordinator(in_process_cluster):
    strategy = PeeredPSStrategy(in_process_cluster)
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)


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


def make_sparse(coordinator, required: int, total: int, start_step: int):
    """A 4x2 table on the ps with sparse accumulators; push rows, take the mean as a dense tensor."""
    strategy, coord = coordinator
    with strategy.scope():
        table = tf.Variable(tf.zeros([4, 2]))
    aggregator = SyncReplicasAggregator([table], required=required, total_slots=total, start_step=start_step, sparse=[True])

    @tf.function
    def push_fn(slot, step, rows, values):
        grads = [unique_rows(tf.IndexedSlices(values, rows, tf.constant([4, 2], tf.int64)), table)]
        with tf.control_dependencies(aggregator.push(slot, step, grads)):
            return tf.constant(1)

    def push(slot: int, step: int, rows: list[int], values: list[list[float]]) -> None:
        args = (slot, tf.constant(step, tf.int64), tf.constant(rows, tf.int64), tf.constant(values, tf.float32))
        coord.schedule(push_fn, args=args).fetch()

    take_fn = tf.function(lambda step, chosen: tf.convert_to_tensor(aggregator.take_mean(step, chosen)[0]))

    def take(step: int, chosen: list[bool]) -> np.ndarray:
        return take_fn(tf.constant(step, tf.int64), tf.constant(chosen)).numpy()

    return push, take


def test_sparse_rows_average_like_a_dense_variable(coordinator):
    """Only touched rows move; a row touched by one of two slots weighs 1/2 (the dense mean), not 1."""
    push, take = make_sparse(coordinator, required=2, total=2, start_step=3)
    push(0, 3, [2, 0, 2], [[1.0, 1.0], [4.0, 4.0], [1.0, 1.0]])  # row 2 twice: summed on the worker
    push(1, 2, [1], [[100.0, 100.0]])  # a straggler of step 2: dropped
    push(1, 3, [2], [[2.0, 0.0]])
    push(1, 3, [2], [[2.0, 0.0]])  # the closure re-run: the slot still counts once
    expected = [[2.0, 2.0], [0.0, 0.0], [2.0, 1.0], [0.0, 0.0]]  # (slot0 + slot1) / 2 per row
    np.testing.assert_array_equal(take(3, [True, True]), expected)


def test_sparse_backup_slot_is_dropped_and_leaves_no_trace(coordinator):
    push, take = make_sparse(coordinator, required=2, total=3, start_step=0)
    push(0, 0, [0], [[2.0, 2.0]])
    push(2, 0, [3], [[50.0, 50.0]])  # not chosen
    push(1, 0, [1], [[4.0, 4.0]])
    np.testing.assert_array_equal(take(0, [True, True, False]), [[1, 1], [2, 2], [0, 0], [0, 0]])
    push(2, 1, [1], [[2.0, 0.0]])
    push(0, 1, [1], [[0.0, 2.0]])
    np.testing.assert_array_equal(take(1, [True, False, True]), [[0, 0], [1, 1], [0, 0], [0, 0]])  # no 50s
