"""Data addressed by (step, slot): deterministic, disjoint within a step, covering each epoch."""

import numpy as np
import pytest

from chief.step.positions import slot_indices

pytestmark = pytest.mark.pure


def test_same_address_same_examples():
    a = slot_indices(1000, 7, step=5, slot=1, slot_batch=32, slots_per_step=2)
    b = slot_indices(1000, 7, step=5, slot=1, slot_batch=32, slots_per_step=2)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, slot_indices(1000, 8, 5, 1, 32, 2))


def test_an_epoch_visits_every_example_once():
    n, batch, slots = 96, 8, 2
    steps_per_epoch = n // (batch * slots)
    seen = np.concatenate(
        [slot_indices(n, 0, step, slot, batch, slots) for step in range(steps_per_epoch) for slot in range(slots)]
    )
    assert sorted(seen.tolist()) == list(range(n))


def test_batches_cross_epoch_boundaries():
    n = 10
    idx = slot_indices(n, 0, step=0, slot=0, slot_batch=25, slots_per_step=1)
    assert len(idx) == 25 and idx.max() < n
    assert sorted(idx[:10].tolist()) == list(range(n))
    # The next epoch is a different shuffle.
    assert not np.array_equal(idx[:10], idx[10:20])


def test_index_shuffle_is_a_permutation_per_epoch_and_deterministic():
    n, batch, slots = 96, 8, 2
    steps_per_epoch = n // (batch * slots)

    def epoch(e: int) -> np.ndarray:
        steps = range(e * steps_per_epoch, (e + 1) * steps_per_epoch)
        return np.concatenate([slot_indices(n, 3, s, k, batch, slots, "index_shuffle") for s in steps for k in range(slots)])

    first, second = epoch(0), epoch(1)
    assert sorted(first.tolist()) == list(range(n)) and sorted(second.tolist()) == list(range(n))
    assert not np.array_equal(first, second) and not np.array_equal(first, np.arange(n))
    assert np.array_equal(first, epoch(0))
    assert not np.array_equal(first, slot_indices(n, 3, 0, 0, n, 1, "permutation"))
