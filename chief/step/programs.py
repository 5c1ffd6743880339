"""The cluster engine's in-graph programs: the worker loop each slot's closure runs, and the apply loop.

A block of K steps is two traced functions (chief/step/dispatch.py calls them once per block):
- `worker_loop`: on a worker, for one slot, steps first..first+count-1: read the step's examples,
  wait at the step gate (chief/step/gate.py), compute the slot's loss, gradients and state deltas
  and push them to the aggregator (chief/step/aggregator.py). Returns one packed int64 vector: the
  worker, then per step [j, epoch, index, hit] (chief/step/block_results.py reads it).
- `apply_loop`: on the ps, per step: take the step's N gradients, check them finite, apply them
  (`apply_step`) and open the next step; it stops at a non-finite step ("stop") or when `stopping`
  is set. Returns one packed float64 [steps, sum(apply_widths)] (chief/step/block_results.py).
`apply_step` is also the standalone engine's update (chief/step/local.py), so both apply alike.
"""

from __future__ import annotations

import tensorflow as tf

from chief.data.readahead import request_tag
from chief.state.model_state import trainable_of
from chief.step.clipping import apply_clipped
from chief.step.gate import ABORT
from chief.step.gradients import all_finite
from chief.step.replica import replica_step


def apply_step(optimizer, variables, state_vars, means) -> None:
    """Apply a step's mean gradients (the first len(variables) of `means`, clipped per whole variable
    as one process clips: chief/step/clipping.py), then the mean state deltas."""
    grads, deltas = means[: len(variables)], means[len(variables) :]
    apply_clipped(optimizer, grads, variables)
    for variable, delta in zip(state_vars, deltas, strict=True):
        variable.assign_add(delta)


def worker_loop(strategy, state, replica, aggregator, gate, source, expected, readahead, backups: bool):
    """The traced worker loop for one slot's closure: `worker_fn(iterator, first, count, slot, positions)`.
    `expected`: the source's fingerprint; `readahead`: a ReadAhead or None; `backups`: more slots than
    the N gradients a step applies (the apply then takes the first N slots to arrive)."""
    global_step = state.global_step

    @tf.function(autograph=False)  # the job's code is converted where it is called (chief/as_written.py)
    def worker_fn(iterator, first, count, slot, positions):
        """Steps first..first+count-1 of `slot`; `positions` [count (+1 with read-ahead), B]."""
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()

        def read(i, step):
            """This step's examples (read before waiting at the gate: they overlap the apply), whether they
            were read ahead (a stream: read from a fresh pipeline), and a stream's [j, epoch, index]."""
            if source.streams:
                batch, where, fresh = source.worker_batch(iterator, step, slot, expected)
                return batch, fresh, where
            nowhere = tf.constant([-1, -1, -1], tf.int64)
            if readahead is None:
                return (*source.worker_batch(next(iterator), positions[i], expected), nowhere)
            tag = request_tag(step, slot, readahead.total_slots)  # ask for the next step's examples first
            with tf.control_dependencies([readahead.request(tag + readahead.total_slots, positions[i + 1])]):
                element = next(iterator)
            return (*source.worker_batch(element, positions[i], expected, tag), nowhere)

        def body(i, token, wheres):
            step = first + tf.cast(i, tf.int64)
            batch, hit, where = read(i, step)
            token = gate.wait(step, global_step)

            def replica_fn(batch, token):
                # The model reads its parameters once the gate let this step through: control edges,
                # opened here as the replica function runs in its own thread, on the examples and on
                # every op the step makes (TF adds a control edge only to ops whose inputs all come from
                # outside the block, so a table gathered by ids looked up from the examples would
                # otherwise be read early). No tf.cond around the model (a lookup layer's per-worker
                # table cannot be captured into a branch) nor around the pushes: a push for a step
                # already applied (a backup's, a re-run's) is dropped by its accumulator, and after
                # ABORT the accumulators are not used again.
                graph = tf.compat.v1.get_default_graph()
                made = len(graph.get_operations())
                with tf.control_dependencies([token]):
                    batch = tf.nest.map_structure(tf.identity, batch)
                    loss, grads, deltas = replica_step(replica, batch, step, slot)
                # A job's assertions (tf.debugging.assert_*, a stateful cond around an Assert) feed
                # nothing: the pushes wait for every stateful op of the step, so a step whose assertion
                # fails is never applied and the error names that step.
                stateful = [op for op in graph.get_operations()[made:] if op._is_stateful]
                with tf.control_dependencies(stateful):
                    pushes = aggregator.push(slot, step, [loss, *grads, *deltas])
                if backups:  # the apply takes the first N slots to arrive
                    pushes = [aggregator.arrive(slot, step, worker, pushes)]
                with tf.control_dependencies(pushes):
                    return tf.equal(token, step)  # whether this slot's gradient can count for its step

            pushed = strategy.run(replica_fn, args=(batch, token))
            wheres = wheres.write(i, tf.concat([tf.cast(where, tf.int64), [tf.cast(hit, tf.int64)]], 0))
            with tf.control_dependencies([pushed]):  # the next step waits for this one's pushes
                return i + 1, token, wheres

        _, _, wheres = tf.while_loop(
            lambda i, token, *_: tf.logical_and(i < count, tf.not_equal(token, ABORT)),
            body,
            (tf.constant(0, tf.int32), tf.constant(0, tf.int64), tf.TensorArray(tf.int64, 0, True)),
            parallel_iterations=1,
        )
        # One packed result (each output costs a fetch RPC): the worker, then per step [j, epoch, index, hit].
        return tf.concat([[tf.cast(worker, tf.int64)], tf.reshape(wheres.stack(), [-1])], 0)

    return worker_fn


def apply_loop(state, replica, aggregator, gate, loss_var, stopping, widths: tuple[int, ...], skip: bool):
    """The traced apply loop: `apply_fn(first, count)`. `loss_var` receives each applied step's mean
    loss; `stopping` (a bool variable on the ps) ends the loop at the next step boundary; `widths`:
    `apply_widths` of the packed result; `skip`: on_nonfinite "skip" (else "stop")."""
    optimizer, global_step = state.optimizer, state.global_step

    @tf.function(autograph=False)
    def apply_means(means):
        """One step's update; as a function call it has finished, every write done, when it returns."""
        apply_step(optimizer, trainable_of(replica.model), replica.state_variables, means)
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
