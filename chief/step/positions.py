"""Which examples feed which gradient: data addressed by (step, replica slot), never by worker.

The chief and the standalone reference compute the same indices, so the schedule of closures,
retries and faults cannot change which examples a step sees. Two shuffles, a result-deciding setting
(`train.shuffle`, recorded in cluster.json):

- "permutation": a NumPy permutation of the data set per epoch (O(N) memory on the chief);
- "index_shuffle": `tf.random.experimental.index_shuffle`, a stateless permutation computed for the
  positions a step needs only (O(batch) memory and time, for data sets of any size).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

SHUFFLES = ("permutation", "index_shuffle")


@lru_cache(maxsize=4)
def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """A fresh shuffle of the data set for every epoch, fixed by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def shuffled(num_examples: int, seed: int, epoch: int, offsets: np.ndarray, shuffle: str) -> np.ndarray:
    """Positions `offsets` of epoch `epoch`'s shuffle of the data set."""
    if shuffle == "index_shuffle":
        import tensorflow as tf

        # The op behind tf.random.experimental.index_shuffle, whose wrapper mis-pads a seed for a vector of
        # positions: one [3] seed row per position, all rows the same.
        seeds = tf.constant(np.tile([seed, epoch, 0x5EED], (len(offsets), 1)), tf.int64)
        return tf.raw_ops.RandomIndexShuffle(
            index=tf.constant(offsets, tf.int64), seed=seeds, max_index=tf.constant(num_examples - 1, tf.int64), rounds=4
        ).numpy()
    return epoch_permutation(num_examples, seed, epoch)[offsets]


def slot_indices(
    num_examples: int, seed: int, step: int, slot: int, slot_batch: int, slots_per_step: int, shuffle: str = "permutation"
) -> np.ndarray:
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
        out[mask] = shuffled(num_examples, seed, int(epoch), offsets[mask], shuffle)
    return out
