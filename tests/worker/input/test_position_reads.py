"""Reading a dataset by position (worker/input/position_reads.py): the fast route (the source's rows, then the
pipeline's maps) gives the elements `tf.data.experimental.at` gives, bit for bit, for the pipelines it
takes, and the pipelines it does not take go the general route."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from worker.input.position_reads import read_positions, source_and_maps

pytestmark = pytest.mark.pure

POSITIONS = [5, 0, 63, 17, 17, 40]


def drawn():
    """issue 35's benchmark pattern: example i drawn from the stateless seed [7, i]."""
    return tf.data.Dataset.range(64).map(lambda i: tf.random.stateless_normal([3], tf.stack([tf.constant(7, tf.int64), i])))


def sliced_dict():
    """from_tensor_slices of a dict of arrays, two maps (one parallel), a tuple out."""
    rng = np.random.default_rng(0)
    arrays = {"x": rng.normal(size=(64, 4)).astype(np.float32), "id": np.arange(64, dtype=np.int64) * 3}
    parsed = tf.data.Dataset.from_tensor_slices(arrays).map(lambda e: {"x": e["x"] * 2.0, "id": e["id"] % 7})
    return parsed.map(lambda e: (e["x"], e["id"]), num_parallel_calls=4)


def sliced_tuple_with_a_table():
    """TF's PSS tutorial's shape: a lookup table applied in the map, over (features, label) slices."""
    table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(["a", "b", "c"]), tf.constant([1, 2, 3], tf.int64)), 0
    )
    words = np.array(["a", "b", "c", "d"] * 16)
    return tf.data.Dataset.from_tensor_slices((words, np.arange(64, dtype=np.float32))).map(lambda w, y: (table.lookup(w), y))


def ranged_with_start_and_step():
    return tf.data.Dataset.range(3, 3 + 64 * 5, 5).map(lambda i: tf.cast(i, tf.float32) * 0.5)


FAST = [drawn, sliced_dict, sliced_tuple_with_a_table, ranged_with_start_and_step]
GENERAL = [
    lambda: tf.data.Dataset.range(64).map(lambda i: i).enumerate(),
    lambda: tf.data.Dataset.zip(tf.data.Dataset.range(64), tf.data.Dataset.range(64)).map(lambda a, b: a + b),
    lambda: tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [2, 3]] * 32)).map(lambda r: r * 2),
]


def by_at(dataset: tf.data.Dataset) -> list:
    return [tf.data.experimental.at(dataset, i) for i in POSITIONS]


@pytest.mark.parametrize("make", FAST, ids=[f.__name__ for f in FAST])
def test_the_fast_route_reads_what_at_reads(make):
    dataset = make()
    assert source_and_maps(dataset) is not None
    batch = tf.function(lambda: read_positions(dataset, tf.constant(POSITIONS, tf.int64)))()
    for row, expected in enumerate(by_at(dataset)):
        got = tf.nest.map_structure(lambda t, row=row: t[row], batch)
        tf.nest.assert_same_structure(got, expected)
        for g, e in zip(tf.nest.flatten(got), tf.nest.flatten(expected), strict=True):
            np.testing.assert_array_equal(g.numpy(), e.numpy())


@pytest.mark.parametrize("make", GENERAL, ids=["enumerate", "zip", "ragged"])
def test_other_pipelines_take_the_general_route(make):
    assert source_and_maps(make()) is None
