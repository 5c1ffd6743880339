"""The sync-replicas aggregator: TF's ConditionalAccumulator ops on the ps, one per (slot, variable).

Worker closures push a step's gradient for their replica slot into that slot's accumulators, with
the step as `local_step`: the accumulator drops it atomically if the step is already over. The
chief then takes the chosen slots' gradients, averages them and applies them once, all on the ps;
nothing proportional to the model passes through the chief. One accumulator per variable (as in
TF1's SyncReplicasOptimizer) lets a worker push each gradient as soon as backprop produced it,
overlapping the transfer with the rest of the backward pass; pushing one flat vector per ps was
measured 13 % slower per step at 10 M parameters (docs/design.md).

A slot's accumulator averages what it holds, so a closure that ClusterCoordinator re-ran (at least
once semantics) pushes the same gradient twice and the slot still yields that gradient once.

Row-sparse variables (embedding tables, see worker/replica/gradients.py) get sparse accumulators instead,
next to their shard: only the touched rows are pushed, held and taken. TF 2.21 has these only as
ref-typed ops, which cannot run eagerly and whose handles cannot cross into a function or a cond
branch: each function and branch that uses one creates the op again under the same `shared_name`
(the ps then hands out the same accumulator), and pushes, which TF does not mark stateful, are
returned so the closure can depend on them (else they are pruned and the take waits forever).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence

import tensorflow as tf

from worker.replica.gradients import summed_rows


class SyncReplicasAggregator:
    """Accumulators for `total_slots` gradients per step, of which `required` are applied."""

    def __init__(
        self,
        variables,
        required: int,
        total_slots: int,
        start_step: int,
        sparse: Sequence[bool] | None = None,
        arrivals_device: str | None = None,
    ):
        """`arrivals_device`: where the queue of arrived slots lives (with backup slots: the apply takes
        the first `required` slots of a step from it); default the first variable's device."""
        self.variables = list(variables)
        self.required = required
        self.total_slots = total_slots
        self.sparse = list(sparse) if sparse is not None else [False] * len(self.variables)
        tag = uuid.uuid4().hex[:8]  # fresh accumulators for every chief incarnation
        self.names = [[f"pstrain_{tag}_slot{slot}_var{i}" for i in range(len(self.variables))] for slot in range(total_slots)]
        self.arrivals_name = f"pstrain_{tag}_arrivals"
        self.arrivals_device = arrivals_device or self.variables[0].device
        self.accumulators: list[list[tf.Tensor | None]] = [
            [None if self.sparse[i] else self._create(v, self.names[slot][i], start_step) for i, v in enumerate(self.variables)]
            for slot in range(total_slots)
        ]
        if any(self.sparse):
            self._start_sparse(tf.constant(start_step, tf.int64))

    @staticmethod
    def _create(variable, name: str, start_step: int) -> tf.Tensor:
        with tf.device(variable.device):
            handle = tf.raw_ops.ResourceConditionalAccumulator(
                dtype=variable.dtype.base_dtype, shape=variable.shape, reduction_type="MEAN", shared_name=name
            )
            tf.raw_ops.ResourceAccumulatorSetGlobalStep(handle=handle, new_global_step=start_step)
        return handle

    def _sparse(self, slot: int, i: int) -> tf.Tensor:
        """The ref handle of a sparse accumulator, created in the current function or branch."""
        variable = self.variables[i]
        with tf.device(variable.device):
            return tf.raw_ops.SparseConditionalAccumulator(
                dtype=variable.dtype.base_dtype, shape=variable.shape, shared_name=self.names[slot][i], reduction_type="MEAN"
            )

    @tf.function(autograph=False)
    def _start_sparse(self, start_step: tf.Tensor) -> tf.Tensor:
        started = [
            tf.raw_ops.AccumulatorSetGlobalStep(handle=self._sparse(slot, i), new_global_step=start_step)
            for slot in range(self.total_slots)
            for i, rows in enumerate(self.sparse)
            if rows
        ]
        with tf.control_dependencies(started):
            return tf.constant(0)

    def push(self, slot: int, step: tf.Tensor, grads: list) -> list[tf.Operation]:
        """Worker side (inside a traced closure): hand this slot's gradients to the ps.

        Returns the pushes; the closure's result must depend on them (`tf.control_dependencies`): TF
        does not mark sparse pushes stateful, so untied they would be pruned.
        """
        pushes = []
        for i, (handle, grad) in enumerate(zip(self.accumulators[slot], grads, strict=True)):
            if not self.sparse[i]:
                pushes.append(tf.raw_ops.ResourceAccumulatorApplyGradient(handle=handle, local_step=step, gradient=grad))
                continue
            pushes.append(
                tf.raw_ops.SparseAccumulatorApplyGradient(
                    handle=self._sparse(slot, i),
                    local_step=step,
                    gradient_indices=grad.indices,
                    gradient_values=grad.values,
                    gradient_shape=tf.constant(self.variables[i].shape.as_list(), tf.int64),
                    has_known_shape=True,
                )
            )
        return pushes

    def _arrivals(self) -> tf.Tensor:
        return tf.raw_ops.FIFOQueueV2(
            component_types=[tf.int64] * 3, shapes=[[], [], []], capacity=-1, shared_name=self.arrivals_name
        )

    def arrive(self, slot: int | tf.Tensor, step: tf.Tensor, worker: tf.Tensor, pushes: list) -> tf.Operation:
        """Worker side, with backup slots: once `pushes` are done, say that `worker` pushed `slot` of `step`."""
        with tf.device(self.arrivals_device), tf.control_dependencies(pushes):
            arrival = [step, tf.cast(slot, tf.int64), tf.cast(worker, tf.int64)]
            return tf.raw_ops.QueueEnqueueV2(handle=self._arrivals(), components=arrival)

    def choose(self, step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """Apply side: the first `required` distinct slots that pushed `step` ([total_slots] bool), the
        worker of each chosen slot ([total_slots] int64, -1 elsewhere), and how many arrivals of earlier
        steps were passed over (late gradients, dropped by their accumulators). Blocks until then.
        Without backup slots every slot is chosen, nothing waits here (the takes do) and no worker is known."""
        unknown = tf.fill([self.total_slots], tf.constant(-1, tf.int64))
        if self.required == self.total_slots:
            return tf.ones([self.total_slots], tf.bool), unknown, tf.constant(0, tf.int64)
        with tf.device(self.arrivals_device):

            def body(chosen, workers, count, late):
                arrival = tf.raw_ops.QueueDequeueV2(handle=self._arrivals(), component_types=[tf.int64] * 3)
                got, slot, worker = (tf.reshape(value, []) for value in arrival)
                new = tf.logical_and(tf.equal(got, step), tf.logical_not(tf.gather(chosen, slot)))
                mark = tf.logical_and(new, tf.one_hot(slot, self.total_slots, True, False))
                workers = tf.where(mark, worker, workers)
                return tf.logical_or(chosen, mark), workers, count + tf.cast(new, tf.int64), late + tf.cast(got < step, tf.int64)

            chosen, workers, _, late = tf.while_loop(
                lambda _, __, count, ___: count < self.required,
                body,
                (tf.zeros([self.total_slots], tf.bool), unknown, tf.constant(0, tf.int64), tf.constant(0, tf.int64)),
                parallel_iterations=1,
            )
            return chosen, workers, late

    def pending_arrivals(self) -> tf.Tensor:
        """Arrivals not yet passed over by `choose` (late gradients of the last step, at the end of a run)."""
        if self.required == self.total_slots:
            return tf.constant(0, tf.int32)
        with tf.device(self.arrivals_device):
            return tf.raw_ops.QueueSizeV2(handle=self._arrivals())

    def unblock(self, step: tf.Tensor) -> tf.Tensor:
        """Chief side, to interrupt an apply waiting for `step`: an empty gradient in every slot (and an
        arrival of each), so its takes return. The step must then not be applied: its means are wrong."""
        pushes = []
        for slot in range(self.total_slots):
            grads = []
            for variable, rows in zip(self.variables, self.sparse, strict=True):
                with tf.device(variable.device):
                    dtype = variable.dtype.base_dtype
                    if rows:
                        empty = tf.zeros([0, *variable.shape[1:]], dtype)
                        grads.append(
                            tf.IndexedSlices(empty, tf.zeros([0], tf.int64), tf.constant(variable.shape.as_list(), tf.int64))
                        )
                    else:
                        grads.append(tf.zeros(variable.shape, dtype))
            slot_pushes = self.push(slot, step, grads)
            if self.required < self.total_slots:
                slot_pushes = [self.arrive(slot, step, tf.constant(-1, tf.int64), slot_pushes)]
            pushes.extend(slot_pushes)
        with tf.control_dependencies(pushes):
            return tf.constant(0)

    def take_mean(self, step: tf.Tensor, chosen: tf.Tensor) -> list:
        """Chief side (inside a traced function): the mean gradient of the `chosen` slots.

        Every accumulator leaves at global step `step + 1`, so late pushes for `step` are dropped;
        an unchosen slot that received a late gradient is flushed so it cannot leak into the next step.
        A row-sparse variable's mean is `tf.IndexedSlices`: the chosen slots' rows, values divided by
        `required`, each row's values summed in slot order (worker/replica/gradients.py `summed_rows`).
        """
        next_step = step + 1
        means = []
        for i, variable in enumerate(self.variables):
            dtype = variable.dtype.base_dtype
            with tf.device(variable.device):
                if self.sparse[i]:
                    means.append(self._sparse_mean(i, chosen, next_step))
                    continue
                if self.total_slots == self.required:  # no backups: every slot is taken, no branches
                    parts = [self._take(row[i], dtype) for row in self.accumulators]
                    means.append(tf.add_n(parts) / tf.cast(self.required, dtype))
                    continue
                parts = [
                    tf.cond(
                        chosen[slot],
                        functools.partial(self._take, self.accumulators[slot][i], dtype),
                        functools.partial(self._flush, self.accumulators[slot][i], dtype, variable.shape, next_step),
                    )
                    for slot in range(self.total_slots)
                ]
                means.append(tf.add_n(parts) / tf.cast(self.required, dtype))
        return means

    def _sparse_mean(self, i: int, chosen: tf.Tensor, next_step: tf.Tensor) -> tf.IndexedSlices:
        variable = self.variables[i]
        dtype = variable.dtype.base_dtype
        if self.total_slots == self.required:
            parts = [self._take_rows(slot, i) for slot in range(self.total_slots)]
        else:
            parts = [
                tf.cond(
                    chosen[slot],
                    functools.partial(self._take_rows, slot, i),
                    functools.partial(self._flush_rows, slot, i, next_step),
                )
                for slot in range(self.total_slots)
            ]
        indices = tf.concat([p[0] for p in parts], axis=0)
        values = tf.concat([p[1] for p in parts], axis=0) / tf.cast(self.required, dtype)
        shape = tf.constant(variable.shape.as_list(), tf.int64)
        return summed_rows(tf.IndexedSlices(values, indices, shape), shape)  # as mean_of_slots: rows once, repeatable

    def _take_rows(self, slot: int, i: int) -> tuple[tf.Tensor, tf.Tensor]:
        # Blocks until the slot holds this step's rows; moves the accumulator to step + 1.
        indices, values, _ = tf.raw_ops.SparseAccumulatorTakeGradient(
            handle=self._sparse(slot, i), num_required=1, dtype=self.variables[i].dtype.base_dtype
        )
        return indices, values

    def _flush_rows(self, slot: int, i: int, next_step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        variable = self.variables[i]
        moved = tf.raw_ops.AccumulatorSetGlobalStep(handle=self._sparse(slot, i), new_global_step=next_step)
        with tf.control_dependencies([moved]):
            late = tf.raw_ops.AccumulatorNumAccumulated(handle=self._sparse(slot, i)) > 0

        def drop():
            indices, _ = self._take_rows(slot, i)
            with tf.control_dependencies([indices]):
                again = tf.raw_ops.AccumulatorSetGlobalStep(handle=self._sparse(slot, i), new_global_step=next_step)
            with tf.control_dependencies([again]):
                return tf.constant(0)

        with tf.control_dependencies([tf.cond(late, drop, lambda: tf.constant(0))]):
            return tf.zeros([0], tf.int64), tf.zeros([0, *variable.shape[1:]], variable.dtype.base_dtype)

    @staticmethod
    def _take(handle, dtype) -> tf.Tensor:
        # Blocks until the slot holds a gradient for this step; moves the accumulator to step + 1.
        return tf.raw_ops.ResourceAccumulatorTakeGradient(handle=handle, num_required=1, dtype=dtype)

    @staticmethod
    def _flush(handle, dtype, shape, next_step: tf.Tensor) -> tf.Tensor:
        tf.raw_ops.ResourceAccumulatorSetGlobalStep(handle=handle, new_global_step=next_step)
        late = tf.raw_ops.ResourceAccumulatorNumAccumulated(handle=handle) > 0

        def drop():
            taken = tf.raw_ops.ResourceAccumulatorTakeGradient(handle=handle, num_required=1, dtype=dtype)
            with tf.control_dependencies([taken]):
                tf.raw_ops.ResourceAccumulatorSetGlobalStep(handle=handle, new_global_step=next_step)
                return tf.constant(0)

        with tf.control_dependencies([tf.cond(late, drop, lambda: tf.constant(0))]):
            return tf.zeros(shape, dtype)
