"""Reading the next step's examples on a worker while the current step computes.

A closure of (step s, slot k) knows its own positions and, from the chief, those of (s + 1, k). It
asks its worker's read-ahead pipeline for the latter, then takes what the pipeline read for its
predecessor on that worker. If that is its own (step, slot), the read is already done; otherwise
(another worker ran slot k last step, a retry, the first step) it reads its positions itself, as
before. Either way the batch is the examples of its (step, slot): read-ahead changes when examples are
read, never which, so a run still equals the standalone one.

The pipeline is a per-worker `tf.data` iterator: a placeholder element first, then one element per
request, each request read in the background (`prefetch`) as soon as the previous element is taken.
Requests reach it through a FIFO queue on the worker, created under one `shared_name` by the dataset
and by every closure (the worker hands out the same queue). Every closure puts exactly one request
before it takes one element, so the pipeline never waits for a request the closure is waiting on:
taking cannot deadlock. A closure that failed between the two leaves one surplus request, after which
that worker's read-ahead only misses (each miss is still read correctly); it never blocks.

Which worker runs which slot is ClusterCoordinator's choice at schedule time; the chief schedules each
step's slots in the order the previous step's finished, which tends to give every worker the slot it
read ahead for (`schedule_order`). The hit rate is reported in the step's timing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

Nest = Any


def request_tag(step: tf.Tensor, slot: tf.Tensor | int, total_slots: int) -> tf.Tensor:
    """One int64 per (step, slot): what a read-ahead element is checked against."""
    return tf.cast(step, tf.int64) * total_slots + tf.cast(slot, tf.int64)


def schedule_order(previous: Sequence[int], total_slots: int) -> list[int]:
    """The slots of a step in the order to schedule them: those of the previous step in the order they
    finished (`previous`), then any others. An idle worker takes the oldest closure, and the worker
    that finished first has waited longest, so it tends to get the slot it ran, and read ahead for."""
    seen = [slot for slot in dict.fromkeys(previous) if 0 <= slot < total_slots]
    return seen + [slot for slot in range(total_slots) if slot not in seen]


class ReadAhead:
    """The per-worker read-ahead pipeline for slot batches of `batch_size` positions."""

    def __init__(self, batch_size: int, total_slots: int):
        self.batch_size = batch_size
        self.total_slots = total_slots
        self.name = f"pstrain_readahead_{uuid.uuid4().hex[:8]}"  # fresh for every chief incarnation

    def _queue(self) -> tf.Tensor:
        """The worker's request queue, created in the current function under the shared name."""
        return tf.raw_ops.FIFOQueueV2(
            component_types=[tf.int64, tf.int64], shapes=[[], [self.batch_size]], capacity=-1, shared_name=self.name
        )

    def dataset(self, read: Callable[[tf.Tensor], Nest]) -> tf.data.Dataset:
        """On the worker: (tag, batch) elements, a placeholder first, then each request read ahead."""

        def take_request(_):
            tag, positions = tf.raw_ops.QueueDequeueV2(handle=self._queue(), component_types=[tf.int64, tf.int64])
            return tf.ensure_shape(tag, []), tf.ensure_shape(positions, [self.batch_size])

        placeholder = tf.data.Dataset.from_tensors((tf.constant(-1, tf.int64), tf.zeros([self.batch_size], tf.int64)))
        requests = tf.data.experimental.Counter().map(take_request)
        return placeholder.concatenate(requests).map(lambda tag, positions: (tag, read(positions))).prefetch(1)

    def request(self, tag: tf.Tensor, positions: tf.Tensor) -> tf.Operation:
        """In the closure: ask this worker's pipeline for `positions` (those of the next step's slot)."""
        return tf.raw_ops.QueueEnqueueV2(handle=self._queue(), components=[tag, positions])

    @staticmethod
    def take(element: tuple[tf.Tensor, Nest], tag: tf.Tensor, read_now: Callable[[], Nest]) -> tuple[Nest, tf.Tensor]:
        """In the closure: the read-ahead batch if it is this closure's, else `read_now()`; and whether it was."""
        ready_tag, ready = element
        hit = tf.equal(ready_tag, tag)
        batch = tf.cond(hit, lambda: ready, read_now)
        return batch, hit
