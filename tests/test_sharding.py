"""Matching variables split across ps tasks to their full-size twins (pure logic, local variables)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from chief.jobs import JobError
from chief.replica import state_variables
from chief.sharding import assign_full, assign_weights, read_full, shard_groups


def test_whole_variables_match_one_to_one():
    assert shard_groups([(3, 4), (4,), ()], [(3, 4), (4,), ()]) == [range(0, 1), range(1, 2), range(2, 3)]


def test_shards_stack_along_the_first_axis():
    shards = [(), (512, 128), (512, 128), (128,), (5, 10), (5, 10), (10,)]
    full = [(), (1024, 128), (128,), (10, 10), (10,)]
    assert shard_groups(shards, full) == [range(0, 1), range(1, 3), range(3, 4), range(4, 6), range(6, 7)]


@pytest.mark.parametrize(
    "shards, full",
    [
        ([(4, 3)], [(4, 2)]),  # trailing dimensions differ
        ([(3, 2), (3, 2)], [(4, 2)]),  # rows overshoot
        ([(2, 2)], [(4, 2)]),  # too few rows
        ([(4, 2), (1,)], [(4, 2)]),  # a shard left over
        ([(), (4,)], [(4,)]),  # a scalar where rows were expected
        ([(4,)], [()]),  # rows where a scalar was expected
    ],
)
def test_mismatched_layouts_are_refused(shards, full):
    with pytest.raises(ValueError):
        shard_groups(shards, full)


def test_values_round_trip_through_shards():
    value = np.arange(30, dtype=np.float32).reshape(10, 3)
    shards = [tf.Variable(tf.zeros((4, 3))), tf.Variable(tf.zeros((6, 3)))]
    assign_full(shards, value)
    np.testing.assert_array_equal(shards[0].numpy(), value[:4])
    np.testing.assert_array_equal(read_full(shards).numpy(), value)


def test_assign_weights_spreads_full_weights_over_shards():
    weights = [np.ones((6, 2), np.float32), np.full((2,), 7.0, np.float32)]
    variables = [tf.Variable(tf.zeros((3, 2))), tf.Variable(tf.zeros((3, 2))), tf.Variable(tf.zeros((2,)))]
    assign_weights(variables, weights)
    assert [v.numpy().tolist() for v in variables] == [[[1, 1]] * 3, [[1, 1]] * 3, [7, 7]]


def test_state_variables_are_found_by_shard_group_not_by_position():
    """A frozen table split in two before a (2, 2) statistic: position 1 of the local copy is the
    statistic, while position 1 among the shards is the table's second shard, of the same shape."""
    part_0, part_1, statistic = tf.Variable(tf.zeros((2, 2))), tf.Variable(tf.zeros((2, 2))), tf.Variable(tf.ones((2, 2)))
    assert state_variables([part_0, part_1, statistic], (1,), [(4, 2), (2, 2)]) == (statistic,)
    assert state_variables([part_0, part_1, statistic], (), [(4, 2), (2, 2)]) == ()


@pytest.mark.parametrize(
    "shapes, message",
    [
        ([(4, 2), (2, 2)], "is sharded across ps tasks"),  # the assigned variable is the split one
        ([(4, 2)], "differ between two builds"),  # the local copy has other variables
    ],
)
def test_state_variables_refuse_split_or_unmatched_state(shapes, message):
    variables = [tf.Variable(tf.zeros((2, 2))), tf.Variable(tf.zeros((2, 2))), tf.Variable(tf.zeros((2, 2)))]
    with pytest.raises(JobError, match=message) as error:
        state_variables(variables, (0,), shapes)
    assert "\n" not in str(error.value)
