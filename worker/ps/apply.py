"""The ps's in-graph program: the apply loop (the worker's side is worker/replica/loop.py).

A block of K steps is two traced functions (chief/step/dispatch.py calls them once per block); this is
the ps's:
- `apply_loop`: on the ps, per step: take the step's N gradients, check them finite, apply them
  (`apply_step`) and open the next step; it stops at a non-finite step ("stop") or when `stopping`
  is set. Returns one packed float64 [steps, sum(apply_widths)] (chief/step/block_results.py).
`apply_step` is also the standalone engine's update (chief/step/local.py), so both apply alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from chief.contract.framework import trainable_of
from worker.ps.clipping import apply_clipped
from worker.replica.gradients import Gradient


def apply_step(optimizer, variables, state_vars, means) -> None:
    """Apply a step's mean gradients (the first len(variables) of `means`, clipped per whole variable
    as one process clips: worker/ps/clipping.py), then the mean state deltas."""
    grads, deltas = means[: len(variables)], means[len(variables) :]
    apply_clipped(optimizer, grads, variables)
    for variable, delta in zip(state_vars, deltas, strict=True):
        variable.assign_add(delta)


def all_finite(values: Sequence[Gradient]) -> tf.Tensor:
    """[len(values)] bool: whether each tensor (a row slice's values) holds only finite numbers. Each
    check runs where its tensor is (on the ps for an aggregated mean): only a bool crosses the network."""
    checks = []
    for value in values:
        dense = value.values if isinstance(value, tf.IndexedSlices) else value
        with tf.device(dense.device):
            checks.append(tf.reduce_all(tf.math.is_finite(dense)))
    return tf.stack(checks)


def apply_loop(state, replica, aggregator, gate, loss_var, stopping, widths: tuple[int, ...], skip: bool, variables=None):
    """The traced apply loop: `apply_fn(first, count)`. `loss_var` receives each applied step's mean
    loss; `stopping` (a bool variable on the ps) ends the loop at the next step boundary; `widths`:
    `apply_widths` of the packed result; `skip`: on_nonfinite "skip" (else "stop"); `variables`: the
    trainable variables updated here (default all; the tables alone when the workers update the dense
    ones, train.dense = "allreduce", the optimizer's step count then moving here as well)."""
    optimizer, global_step = state.optimizer, state.global_step

    @tf.function(autograph=False)
    def apply_means(means):
        """One step's update; as a function call it has finished, every write done, when it returns."""
        if variables is None:
            apply_step(optimizer, trainable_of(replica.model), replica.state_variables, means)
        elif variables:
            apply_step(optimizer, variables, (), means)
        else:  # only dense variables, updated on the workers: the step count moves as an update moves it
            optimizer.iterations.assign_add(1)
        return tf.constant(True)

    @tf.function(autograph=False)
    def apply_fn(first, count):
        """Take, check and apply steps first..first+count-1 as their gradients arrive; stops early at a
        non-finite step (on_nonfinite "stop") or when `stopping` is set. Per step taken: the loss,
        the chosen slots and their workers, late arrivals, which values were finite, whether applied."""

        def body(i, go, out):
            step = first + tf.cast(i, tf.int64)
            chosen, workers, late = aggregator.choose(step)
            means = aggregator.take_mean(step, chosen)
            finite = all_finite(means)
            ok = tf.reduce_all(finite)
            with tf.control_dependencies([ok]):  # read once the takes returned: an interrupt's pushes woke them
                proceed = tf.logical_not(stopping.read_value())

            def advance(apply: bool):
                def fn():
                    deps = [apply_means(means[1:]), loss_var.assign(means[0])] if apply else []
                    with tf.control_dependencies(deps):
                        moved = global_step.assign(step + 1)
                    with tf.control_dependencies([moved]):
                        return tf.identity(gate.advance(step) >= 0)

                return fn

            def end():
                return tf.logical_not(tf.equal(gate.abort(), -1))  # False, once every closure is let through

            if skip:
                go = tf.cond(proceed, lambda: tf.cond(ok, advance(True), advance(False)), end)
            else:
                go = tf.cond(tf.logical_and(proceed, ok), advance(True), end)
            # `proceed` False: interrupted before this step's update, which is not a result.
            row = (means[0], chosen, workers, late, finite, proceed)
            out = [array.write(i, value) for array, value in zip(out, row, strict=True)]
            with tf.control_dependencies([go]):
                return i + 1, go, out

        dtypes = (tf.float32, tf.bool, tf.int64, tf.int64, tf.bool, tf.bool)
        shapes = ([], [widths[1]], [widths[2]], [], [widths[4]], [])  # per step: see apply_widths
        arrays = [tf.TensorArray(d, 0, dynamic_size=True, element_shape=e) for d, e in zip(dtypes, shapes, strict=True)]
        _, _, out = tf.while_loop(
            lambda i, go, _: tf.logical_and(i < count, go),
            body,
            (tf.constant(0, tf.int32), tf.logical_not(stopping.read_value()), arrays),
            parallel_iterations=1,
        )
        # One packed result, as each output costs the chief a fetch: float64 holds every value exactly.
        return tf.concat([tf.reshape(tf.cast(a.stack(), tf.float64), [-1, w]) for a, w in zip(out, widths, strict=True)], 1)

    return apply_fn
