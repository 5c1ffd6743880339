"""The sync-replicas aggregator: TF's ConditionalAccumulator ops on the ps, one per (slot, ps task).

Worker closures push a step's gradient for their replica slot into that slot's accumulators, with
the step as `local_step`: the accumulator drops it atomically if the step is already over. The
chief then takes the chosen slots' gradients, averages them and applies them once, all on the ps;
nothing proportional to the model passes through the chief.

A slot's accumulator averages what it holds, so a closure that ClusterCoordinator re-ran (at least
once semantics) pushes the same gradient twice and the slot still yields that gradient once.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass

import numpy as np
import tensorflow as tf


@dataclass(frozen=True)
class VariableGroup:
    """The trainable variables on one ps device, pushed and pulled as one flat vector."""

    device: str
    dtype: tf.DType
    indices: tuple[int, ...]  # positions in the model's trainable_variables
    shapes: tuple[tf.TensorShape, ...]

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(s)) for s in self.shapes]


def group_by_device(variables) -> list[VariableGroup]:
    groups: dict[tuple[str, tf.DType], list[int]] = {}
    for i, v in enumerate(variables):
        groups.setdefault((v.device, v.dtype.base_dtype), []).append(i)
    return [
        VariableGroup(device, dtype, tuple(idx), tuple(variables[i].shape for i in idx))
        for (device, dtype), idx in groups.items()
    ]


class SyncReplicasAggregator:
    """Accumulators for `total_slots` gradients per step, of which `required` are applied."""

    def __init__(self, variables, required: int, total_slots: int, start_step: int):
        self.variables = list(variables)
        self.required = required
        self.total_slots = total_slots
        self.groups = group_by_device(self.variables)
        tag = uuid.uuid4().hex[:8]  # fresh accumulators for every chief incarnation
        self.accumulators: list[list[tf.Tensor]] = []
        for slot in range(total_slots):
            row = []
            for g, group in enumerate(self.groups):
                with tf.device(group.device):
                    handle = tf.raw_ops.ResourceConditionalAccumulator(
                        dtype=group.dtype,
                        shape=[sum(group.sizes)],
                        reduction_type="MEAN",
                        shared_name=f"pstrain_{tag}_slot{slot}_group{g}",
                    )
                    tf.raw_ops.ResourceAccumulatorSetGlobalStep(handle=handle, new_global_step=start_step)
                row.append(handle)
            self.accumulators.append(row)

    def push(self, slot: int, step: tf.Tensor, grads: list[tf.Tensor]) -> None:
        """Worker side (inside a traced closure): hand this slot's gradient to the ps."""
        for group, handle in zip(self.groups, self.accumulators[slot], strict=True):
            flat = tf.concat([tf.reshape(grads[i], [-1]) for i in group.indices], axis=0)
            tf.raw_ops.ResourceAccumulatorApplyGradient(handle=handle, local_step=step, gradient=flat)

    def take_mean(self, step: tf.Tensor, chosen: tf.Tensor) -> list[tf.Tensor]:
        """Chief side (inside a traced function): the mean gradient of the `chosen` slots.

        Every accumulator leaves at global step `step + 1`, so late pushes for `step` are dropped;
        an unchosen slot that received a late gradient is flushed so it cannot leak into the next step.
        """
        next_step = step + 1
        grads: list[tf.Tensor | None] = [None] * len(self.variables)
        for g, group in enumerate(self.groups):
            size = sum(group.sizes)
            with tf.device(group.device):
                total = None
                for slot in range(self.total_slots):
                    handle = self.accumulators[slot][g]
                    part = tf.cond(
                        chosen[slot],
                        functools.partial(self._take, handle, group.dtype),
                        functools.partial(self._flush, handle, group.dtype, size, next_step),
                    )
                    total = part if total is None else total + part
                mean = total / tf.cast(self.required, group.dtype)
                pieces = tf.split(mean, group.sizes)
                for i, piece, shape in zip(group.indices, pieces, group.shapes, strict=True):
                    grads[i] = tf.reshape(piece, shape)
        return grads

    @staticmethod
    def _take(handle, dtype) -> tf.Tensor:
        # Blocks until the slot holds a gradient for this step; moves the accumulator to step + 1.
        return tf.raw_ops.ResourceAccumulatorTakeGradient(handle=handle, num_required=1, dtype=dtype)

    @staticmethod
    def _flush(handle, dtype, size: int, next_step: tf.Tensor) -> tf.Tensor:
        tf.raw_ops.ResourceAccumulatorSetGlobalStep(handle=handle, new_global_step=next_step)
        late = tf.raw_ops.ResourceAccumulatorNumAccumulated(handle=handle) > 0

        def drop():
            with tf.control_dependencies(
                [tf.raw_ops.ResourceAccumulatorTakeGradient(handle=handle, num_required=1, dtype=dtype)]
            ):
                tf.raw_ops.ResourceAccumulatorSetGlobalStep(handle=handle, new_global_step=next_step)
                return tf.constant(0)

        with tf.control_dependencies([tf.cond(late, drop, lambda: tf.constant(0))]):
            return tf.zeros([size], dtype)
