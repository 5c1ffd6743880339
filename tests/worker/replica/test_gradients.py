"""worker/replica/gradients.py: a step's sparse mean holds each row once, so its update is repeatable."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from worker.replica.gradients import mean_of_slots

pytestmark = pytest.mark.pure

ROWS, DIM, PER_SLOT = 200_000, 64, 1_500  # two slots' rows: more than 1,023, so TF's CPU scatter runs threaded


def _slots(rng) -> list[list[tf.IndexedSlices]]:
    shape = tf.constant([ROWS, DIM], tf.int64)
    common = rng.choice(ROWS, 400, replace=False)  # rows both slots touch
    slots = []
    for _ in range(2):
        rows = np.unique(np.concatenate([common, rng.choice(ROWS, PER_SLOT - 400, replace=False)]))
        values = rng.normal(0, 1e-3, (len(rows), DIM)).astype(np.float32)
        slots.append([tf.IndexedSlices(tf.constant(values), tf.constant(rows, tf.int64), shape)])
    return slots


def test_the_mean_of_two_slots_holds_each_row_once_summed_in_slot_order():
    slots = _slots(np.random.default_rng(1))
    (mean,) = mean_of_slots(slots, 2)
    indices = mean.indices.numpy()
    assert np.array_equal(indices, np.unique(indices)), "rows repeated or unsorted"
    want = {}
    for (g,) in slots:  # slot 0 first
        for row, value in zip(g.indices.numpy(), g.values.numpy() / np.float32(2), strict=True):
            want[row] = want[row] + value if row in want else value
    assert np.array_equal(mean.values.numpy(), np.stack([want[r] for r in indices]))


def test_sgd_on_the_mean_of_two_slots_is_the_same_every_time():
    slots = _slots(np.random.default_rng(2))
    start = np.random.default_rng(3).uniform(-0.05, 0.05, (ROWS, DIM)).astype(np.float32)
    table = tf.Variable(start)
    optimizer = tf_keras.optimizers.legacy.SGD(0.05)

    @tf.function(autograph=False)
    def step():
        table.assign(start)
        optimizer.apply_gradients([(mean_of_slots(slots, 2)[0], table)])
        return table.read_value()

    first = step().numpy()
    differing = sum(not np.array_equal(step().numpy(), first) for _ in range(15))
    assert differing == 0, f"{differing} of 15 updates differ from the first"
