"""Matching variables split across ps tasks to their full-size twins (pure logic, local variables)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from chief.state.sharding import copy_rows, read_full, shard_groups

pytestmark = pytest.mark.pure


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


def test_values_round_trip_through_shards_in_chunks():
    """Chunks smaller than a shard, and shards that straddle chunk and shard boundaries of the other side."""
    value = np.arange(30, dtype=np.float32).reshape(10, 3)
    full = tf.Variable(value)
    shards = [tf.Variable(tf.zeros((4, 3))), tf.Variable(tf.zeros((6, 3)))]
    copy_rows([full], shards, chunk_bytes=2 * 3 * 4 + 4)  # 2 rows per chunk
    np.testing.assert_array_equal(shards[0].numpy(), value[:4])
    np.testing.assert_array_equal(read_full(shards).numpy(), value)
    other = [tf.Variable(tf.zeros((3, 3))), tf.Variable(tf.zeros((3, 3))), tf.Variable(tf.zeros((4, 3)))]
    copy_rows(shards, other, chunk_bytes=12)  # 1 row per chunk
    np.testing.assert_array_equal(read_full(other).numpy(), value)
    back = tf.Variable(tf.zeros((10, 3)))
    copy_rows(other, [back])
    np.testing.assert_array_equal(back.numpy(), value)


def test_small_and_scalar_variables_are_copied_whole():
    step, copy = tf.Variable(7, dtype=tf.int64), tf.Variable(0, dtype=tf.int64)
    copy_rows([step], [copy])
    assert int(copy.numpy()) == 7
