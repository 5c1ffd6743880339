"""Where a job's examples live, and how the examples of one (step, slot) are read where they are used.

This module holds what every source is (`Source`), its fingerprint and `DataError`. A source is built
on each worker by TensorFlow ops (the chief only traces `dataset_fn`), so no data passes through the
chief or sits in a graph as a constant. Two kinds read by position, and a stream:

- `TableSource` (worker/input/tables.py): arrays in `.npy` files (the job's own, or those pstrain writes from `train_data()`)
  read once into the worker's memory; a closure gathers its rows (a gather, as fast as an in-memory
  array).
- `DatasetSource` (worker/input/datasets.py): the job's `tf.data.Dataset` of single examples (element i = example i), read by
  position with `tf.data.experimental.at` in a parallel map, so memory does not grow with the set.
- `StreamSource` (worker/input/streams.py): a pipeline that cannot be read by position.

Which one a job gets: chief/data/train_source.py.

Both engines read through the same code: the standalone process reads the same positions locally.
Each worker's source carries a fingerprint (cardinality + a digest of sampled examples) that every
closure compares with the chief's before it computes, so different data on one worker is refused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from chief.contract.job import JobError
from worker.input.readahead import ReadAhead

Nest = Any
SAMPLES = 16  # examples digested per fingerprint: first, last and evenly spaced between
MISMATCH_TAG = "pstrain-data-mismatch"
# Examples read at once by a closure. A fixed number, not AUTOTUNE: each closure's read is a fresh,
# one-batch pipeline that autotuning never warms up for (128 one-file reads: 7.2 ms with AUTOTUNE,
# 3.2 ms with 64, in one process on this machine).
READ_PARALLELISM = 64


class DataError(JobError):
    """Data that is missing or differs on a worker; the message names the worker, its host and what."""


@dataclass(frozen=True)
class Fingerprint:
    cardinality: int
    digest: int  # farmhash of the serialized sampled examples, as int64


def sample_positions(num_examples: int, samples: int = SAMPLES) -> np.ndarray:
    """The positions a fingerprint digests: spread over the whole set, first and last included."""
    return np.unique(np.linspace(0, num_examples - 1, min(samples, num_examples)).round().astype(np.int64))


def digest(batch: Nest) -> tf.Tensor:
    """An int64 digest of a nest of tensors (TF ops: runs alike on the chief and on a worker)."""
    serialized = tf.stack([tf.io.serialize_tensor(leaf) for leaf in tf.nest.flatten(batch)])
    rows = tf.fingerprint(serialized)  # [leaves, 8] uint8
    return tf.bitcast(tf.reshape(tf.fingerprint(tf.reshape(rows, [1, -1])), [8]), tf.int64)


def check_fingerprint(cardinality: tf.Tensor, found: tf.Tensor, expected: Fingerprint) -> tf.Operation:
    """In a closure: stop with a tagged error (see `explain_worker_error`) if the worker's data differs."""
    worker = tf.distribute.coordinator.experimental_get_current_worker_index()
    same = tf.logical_and(tf.equal(cardinality, expected.cardinality), tf.equal(found, expected.digest))
    return tf.debugging.Assert(
        same,
        [MISMATCH_TAG, "worker", worker, "cardinality", cardinality, expected.cardinality, "digest", found, expected.digest],
    )


class Source(ABC):
    """Examples 0..num_examples-1, readable by position on a worker and in this process."""

    num_examples: int

    @abstractmethod
    def read_local(self, indices: np.ndarray) -> Nest:
        """The examples at `indices` as a nest of tensors with a leading batch axis, read in this process."""

    @abstractmethod
    def _build(self) -> tuple[tf.Tensor, Nest]:
        """TF ops run on the worker (inside a dataset map): (cardinality, handle to read from)."""

    @abstractmethod
    def _read(self, handle: Nest, indices: tf.Tensor) -> Nest:
        """TF ops: the examples at `indices` from what `_build` made."""

    def first(self, n: int) -> Nest:
        """The first (up to) `n` examples, read in this process."""
        return self.read_local(np.arange(min(self.num_examples, n)))

    def fingerprint(self) -> Fingerprint:
        """The chief's expectation, from its own view of the data (touches only the sampled examples)."""
        batch = self.read_local(sample_positions(self.num_examples))
        return Fingerprint(self.num_examples, int(digest(batch).numpy()))

    streams = False  # read by position (a stream: worker/input/streams.py)
    reads_ahead = False  # whether `dataset_fn` uses a ReadAhead (a gather from memory needs none: it is ignored)

    def dataset_fn(self, readahead: ReadAhead | None = None) -> tf.data.Dataset:
        """Per-worker dataset: one element ((cardinality, digest), handle), repeated.

        The source is built lazily by the first closure's `next()` (and then cached), so a failure
        such as a missing file surfaces in that closure with the worker's name, not as a hang.
        """
        positions = tf.constant(sample_positions(self.num_examples))

        def build(_):
            cardinality, handle = self._build()
            safe = tf.minimum(positions, tf.maximum(cardinality - 1, 0))  # a shorter set must not fail the gather
            return (cardinality, digest(self._read(handle, safe))), handle

        return tf.data.Dataset.range(1).map(build).cache().repeat()

    def worker_batch(
        self, element: Nest, indices: tf.Tensor, expected: Fingerprint, tag: tf.Tensor | None = None
    ) -> tuple[Nest, tf.Tensor]:
        """In the closure: check the worker's fingerprint against the chief's, then the slot's examples.

        `element` is the per-worker dataset's; with read-ahead (`tag` given, see worker/input/readahead.py)
        the batch read ahead is used when it is this closure's. Returns (batch, whether it was).
        """
        (cardinality, found), handle = element[0], element[1]
        check = check_fingerprint(cardinality, found, expected)
        with tf.control_dependencies([check]):  # no example reaches the model before the check passed
            if tag is None:
                return self._read(handle, tf.identity(indices)), tf.constant(False)
            batch, hit = ReadAhead.take(element[2], tag, lambda: self._read(handle, indices))
            return tf.nest.map_structure(tf.identity, batch), hit
