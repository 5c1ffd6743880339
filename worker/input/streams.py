"""A `train_dataset()` read as a stream: any tf.data pipeline, in its own order, on every worker.

For pipelines that cannot be read by position (`TFRecordDataset`, `interleave`, `filter`,
`flat_map`, `parse_example`, unknown or infinite cardinality). The stream is fixed by the job and
the slot batch B alone:

- epoch e is the job's pipeline, made afresh, batched by B; the last partial batch of an epoch is
  dropped (Keras's `drop_remainder=True`), and epochs follow each other without end (a pipeline that
  repeats itself is one endless epoch);
- stream batch j is the batch of (step j // M, slot j % M), M = total_num_replicas: steps run on
  through epoch ends, so a step may hold the last batches of one epoch and the first of the next.

Each worker keeps one forward-only iterator over the whole stream, built on the worker from its own
files (`dataset_fn`), and a position (the next batch its iterator yields) in a table on the worker.
A closure for (step, slot) skips its iterator forward to batch j, discarding the batches of the
slots other workers run, in-graph (`worker_batch`); if its worker is already past j (a closure run
again, two slots of one step on one worker in the reverse order) it reads batch j from a fresh
pipeline instead, from the start of j's epoch once the worker has seen an epoch end. Every batch
read carries (j, epoch, batch in epoch), checked against j. The standalone engine reads the same
stream in this process.

The position is a function of the step, so a checkpoint needs nothing more; only the epoch length
(L batches) is learnt once the first epoch ended, written to RUN_DIR/stream.json, and then used to
resume at the epoch of the step instead of reading the stream from its start. Every later batch is
checked against it (epochs of different lengths stop the run).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from chief.contract.job import JobError
from worker.input.datasets import DatasetSource, one_shape
from worker.input.sources import SAMPLES, DataError, Fingerprint, check_fingerprint, digest

Nest = Any
UNKNOWN = -2  # a stream's cardinality in its fingerprint
ORDER_TAG = "pstrain-stream-order"


class StreamSource:
    """The job's pipeline as an endless stream of slot batches (see the module docstring)."""

    streams = True
    reads_ahead = False  # the worker's iterator reads ahead by itself (prefetch)

    def __init__(self, make: Callable[[], tf.data.Dataset], what: str, record: Path | None, slot_batch=0, slots=0):
        """`record`: where the learnt epoch length is kept (RunDir.stream_record; None: nowhere). `slot_batch`
        B and `slots` M (total_num_replicas) are needed to train; without them (the evaluator sidecar) only
        `first` and `fingerprint` work."""
        self.make, self.what = make, what
        self.slot_batch, self.slots = slot_batch, slots
        self.record = record
        self.batches_per_epoch: int | None = self._recorded()
        self.start = 0  # the first stream batch of this run: first step * M
        self.position_name = f"pstrain_stream_{uuid.uuid4().hex[:8]}"  # the workers' position tables
        # Built once as the workers build it, inside a function: what only fails there (a layer's adapt())
        # is refused here, in one line, and not from inside a pipeline's traced function.
        tf.function(lambda: self._made().cardinality(), autograph=False).get_concrete_function()
        with one_shape(what):
            first = self.fingerprint().digest
        if first != self.fingerprint().digest:
            raise JobError(
                f"{what}: two builds of the pipeline gave different first examples; its order must be fixed "
                "(list_files(..., shuffle=False), shuffle(..., seed=S), deterministic interleave/map, no unseeded "
                "random ops: augment in the model, whose random layers draw by (step, slot))"
            )

    def _made(self) -> tf.data.Dataset:
        return DatasetSource.made(self.make, self.what)

    def _recorded(self) -> int | None:
        if self.record is None or not self.record.exists():
            return None
        saved = json.loads(self.record.read_text())
        return saved["batches_per_epoch"] if saved.get("slot_batch_size") == self.slot_batch else None

    # --- in this process ---------------------------------------------------------------------------

    def first(self, n: int) -> Nest:
        """The first (up to) `n` examples of the pipeline, read in this process."""
        return self._made().take(n).batch(n).get_single_element()

    def fingerprint(self) -> Fingerprint:
        return Fingerprint(UNKNOWN, int(digest(self.first(SAMPLES)).numpy()))

    def begin(self, first_step: int) -> None:
        """Start this run's stream at `first_step` (the chief and the standalone process, before `dataset_fn`)."""
        self.start = first_step * self.slots

    def first_batch(self) -> Nest:
        """Stream batch 0 (step 0, slot 0), read in this process: what the job is checked on. An epoch
        without one full batch is refused (the stream would never yield one)."""
        for batch in self._made().batch(self.slot_batch, drop_remainder=True).take(1):
            return batch
        raise JobError(
            f"{self.what}: the pipeline yields fewer examples than one slot batch ({self.slot_batch}); "
            "give more examples or a smaller --global-batch-size"
        )

    def local_batches(self) -> Iterator[tuple[np.ndarray, Nest]]:
        """This run's stream in this process: ([j, epoch, batch in epoch], batch) from batch `start` on."""
        for j, (epoch, index, batch) in self.batches(self.start):
            yield np.array([j, epoch, index]), batch

    # --- TF ops (on a worker, or here) ------------------------------------------------------------

    def batches(self, start, per_epoch=None) -> tf.data.Dataset:
        """(j, (epoch, batch in epoch, batch)) for j = start, start + 1, ...: read from the start of j's
        epoch when the epoch length is known (`per_epoch`, default the chief's; 0: unknown), else from
        the stream's start. `start` and `per_epoch` are ints or tensors."""
        size = self.slot_batch
        start = tf.cast(start, tf.int64)
        per_epoch = tf.cast((self.batches_per_epoch or 0) if per_epoch is None else per_epoch, tf.int64)
        first_epoch = tf.where(per_epoch > 0, start // tf.maximum(per_epoch, 1), 0)

        def epoch(e):
            batched = self._made().batch(size, drop_remainder=True).enumerate()
            return batched.map(lambda i, batch: (e, i, batch))

        stream = tf.data.Dataset.range(first_epoch, np.iinfo(np.int64).max).flat_map(epoch)
        return stream.skip(start - first_epoch * per_epoch).enumerate(start)

    def _with_checks(self, start, per_epoch=None) -> tf.data.Dataset:
        """((cardinality, digest), stream element) pairs: the worker's fingerprint beside each batch."""

        def fingerprint(_):
            sampled = self._made().take(SAMPLES).batch(SAMPLES).get_single_element()
            return tf.constant(UNKNOWN, tf.int64), digest(sampled)

        checks = tf.data.Dataset.range(1).map(fingerprint).cache().repeat()
        return tf.data.Dataset.zip((checks, self.batches(start, per_epoch)))

    def dataset_fn(self, readahead=None) -> tf.data.Dataset:
        """Per-worker dataset: this run's stream from batch `start`, read ahead a step's worth."""
        return self._with_checks(self.start).prefetch(max(self.slots, 1))

    def _table(self) -> tf.Tensor:
        """The worker's table, created in the current function under a shared name: key 0 its iterator's
        position (the next batch it yields), key 1 the epoch length as far as this worker has seen."""
        return tf.raw_ops.MutableHashTableV2(key_dtype=tf.int64, value_dtype=tf.int64, shared_name=self.position_name)

    def worker_batch(self, iterator, step: tf.Tensor, slot: tf.Tensor, expected: Fingerprint) -> tuple[Nest, tf.Tensor, Any]:
        """In the closure (or a loop in it; `step` may be symbolic): the batch of (step, slot) from this
        worker's iterator, after its fingerprint is checked against the chief's. Returns (batch,
        [j, epoch, batch in epoch], whether it was read from a fresh pipeline)."""
        j = tf.cast(step, tf.int64) * self.slots + tf.cast(slot, tf.int64)
        position_key, length_key = tf.constant(0, tf.int64), tf.constant(1, tf.int64)
        start = tf.constant(self.start, tf.int64)  # a fresh worker's iterator starts at this run's start
        position = tf.raw_ops.LookupTableFindV2(table_handle=self._table(), keys=position_key, default_value=start)
        known = tf.constant(self.batches_per_epoch or 0, tf.int64)
        per_epoch = tf.raw_ops.LookupTableFindV2(table_handle=self._table(), keys=length_key, default_value=known)

        def forward():  # discard the batches before j (other slots'), then take j
            def discard(i):
                element = iterator.get_next()
                with tf.control_dependencies(tf.nest.flatten(element)[:1]):
                    return (i + 1,)

            (skipped,) = tf.while_loop(lambda i: i < j - position, discard, (tf.constant(0, tf.int64),))
            with tf.control_dependencies([skipped]):
                element = iterator.get_next()
            moved = tf.raw_ops.LookupTableInsertV2(table_handle=self._table(), keys=position_key, values=j + 1)
            with tf.control_dependencies([moved]):
                return tf.nest.map_structure(tf.identity, element)

        def fresh():  # this worker is past j: a new pipeline, from j's epoch once the worker saw an epoch end
            return self._with_checks(j, per_epoch).take(1).get_single_element()

        behind = tf.less(j, position)
        (cardinality, found), (got, (epoch, index, batch)) = tf.cond(behind, fresh, forward)
        check = check_fingerprint(cardinality, found, expected)
        order = tf.debugging.Assert(tf.equal(got, j), [ORDER_TAG, "wanted", j, "got", got])
        learnt = tf.where(epoch > 0, (got - index) // tf.maximum(epoch, 1), per_epoch)
        remember = tf.raw_ops.LookupTableInsertV2(table_handle=self._table(), keys=length_key, values=learnt)
        with tf.control_dependencies([check, order, remember]):
            return tf.nest.map_structure(tf.identity, batch), tf.stack([got, epoch, index]), behind

    # --- the epoch length, learnt when the first epoch ends ----------------------------------------------

    def observe(self, positions) -> None:
        """Learn the epoch length from batches read ([j, epoch, batch in epoch] each) and check every
        batch against it; the length is written to RUN_DIR/stream.json when first learnt."""
        for j, epoch, index in (tuple(int(v) for v in p) for p in positions):
            if epoch > 0 and self.batches_per_epoch is None:
                if (j - index) % epoch:
                    raise self._uneven(j, epoch, index)
                self.batches_per_epoch = (j - index) // epoch
                if self.record is not None:
                    tmp = self.record.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"slot_batch_size": self.slot_batch, "batches_per_epoch": self.batches_per_epoch}))
                    tmp.replace(self.record)
            if self.batches_per_epoch is not None and j != epoch * self.batches_per_epoch + index:
                raise self._uneven(j, epoch, index)

    def _uneven(self, j: int, epoch: int, index: int) -> DataError:
        return DataError(
            f"{self.what}: stream batch {j} is batch {index} of epoch {epoch}, but epochs had "
            f"{self.batches_per_epoch} batches of {self.slot_batch}; the pipeline must yield the same examples every epoch"
        )

    def epoch_of(self, step: int) -> int:
        """The epoch of the step's first batch (0 until the first epoch's end is seen)."""
        return step * self.slots // self.batches_per_epoch if self.batches_per_epoch else 0
