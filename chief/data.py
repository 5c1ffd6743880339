"""Which examples feed which gradient: data addressed by (step, replica slot), never by worker.

Pure NumPy: the chief and the standalone reference compute the same indices, so the schedule of
closures, retries and faults cannot change which examples a step sees.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4)
def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """A fresh shuffle of the data set for every epoch, fixed by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def slot_indices(num_examples: int, seed: int, step: int, slot: int, slot_batch: int, slots_per_step: int) -> np.ndarray:
    """Indices of the `slot_batch` examples behind gradient `slot` of `step`.

    Steps walk through the shuffled data set in order, `slots_per_step * slot_batch` positions at a
    time; a batch that crosses an epoch boundary continues in the next epoch's shuffle.
    """
    start = (step * slots_per_step + slot) * slot_batch
    positions = np.arange(start, start + slot_batch, dtype=np.int64)
    epochs, offsets = np.divmod(positions, num_examples)
    out = np.empty(slot_batch, dtype=np.int64)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        out[mask] = epoch_permutation(num_examples, seed, int(epoch))[offsets[mask]]
    return out
