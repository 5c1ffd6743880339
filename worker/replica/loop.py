"""The worker's in-graph program: the loop each slot's closure runs (the ps's side is worker/ps/apply.py).

A block of K steps is two traced functions (chief/step/dispatch.py calls them once per block); this is
the workers':
- `worker_loop`: on a worker, for one slot, steps first..first+count-1: read the step's examples,
  wait at the step gate (worker/ps/gate.py), compute the slot's loss, gradients and state deltas
  and push them to the aggregator (worker/ps/aggregator.py). Returns one packed int64 vector: the
  worker, then per step [j, epoch, index, hit] (chief/step/block_results.py reads it).
- `lean_loop`: the hybrid step (train.dense = "allreduce") of a model without row-sparse tables, with
  no ps on a step's path (no gate, no push): the workers exchange and decide everything themselves.
"""

from __future__ import annotations

import tensorflow as tf

from worker.input.readahead import request_tag
from worker.ps.gate import ABORT
from worker.replica.allreduce import apply_after_gate, hybrid_step, lean_step
from worker.replica.replica import replica_step


def reader(source, expected, readahead, iterator, slot, positions):
    """`read(i, step)` for a closure: step `step`'s examples (the block's i-th; read before waiting at
    the gate: they overlap the apply), whether they were read ahead (a stream: read from a fresh
    pipeline), and a stream's [j, epoch, index]."""

    def read(i, step):
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

    return read


def stateful_since(graph, made: int) -> list:
    """The stateful ops `graph` gained since it had `made` operations: a job's assertions feed nothing,
    so what a step writes waits for them (a step whose assertion fails is never applied and the
    error names that step)."""
    return [op for op in graph.get_operations()[made:] if op._is_stateful]


def worker_loop(strategy, state, replica, aggregator, gate, source, expected, readahead, backups: bool, dense=None):
    """The traced worker loop for one slot's closure: `worker_fn(iterator, first, count, slot, positions)`.
    `expected`: the source's fingerprint; `readahead`: a ReadAhead or None; `backups`: more slots than
    the N gradients a step applies (the apply then takes the first N slots to arrive); `dense`: the
    workers' copies (chief/step/hybrid.py DenseCopies) with train.dense = "allreduce", else None."""
    global_step = state.global_step

    @tf.function(autograph=False)  # the job's code is converted where it is called (chief/contract/as_written.py)
    def worker_fn(iterator, first, count, slot, positions):
        """Steps first..first+count-1 of `slot`; `positions` [count (+1 with read-ahead), B]."""
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()

        read = reader(source, expected, readahead, iterator, slot, positions)

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
                    if dense is None:
                        loss, grads, deltas = replica_step(replica, batch, step, slot)
                        values = [loss, *grads, *deltas]
                    else:
                        values, means = hybrid_step(replica, dense, batch, step, slot)
                # A job's assertions (tf.debugging.assert_*, a stateful cond around an Assert): the
                # pushes wait for every stateful op of the step.
                with tf.control_dependencies(stateful_since(graph, made)):
                    pushes = aggregator.push(slot, step, values)
                if backups:  # the apply takes the first N slots to arrive
                    pushes = [aggregator.arrive(slot, step, worker, pushes)]
                with tf.control_dependencies(pushes):
                    counted = tf.equal(token, step)  # whether this slot's gradient can count for its step
                return counted if dense is None else (counted, means)

            pushed = strategy.run(replica_fn, args=(batch, token))
            if dense is not None:
                pushed = apply_after_gate(strategy, dense, gate, global_step, step, *pushed)
                # A step the ps did not apply ends the block (the hybrid takes no backups, no skips): the
                # copies stay at it, so this closure ends too, rather than run a step whose copies' check
                # would fail (an error in TF's log per closure, and exit 75 for a chief that met one).
                token = tf.where(pushed, token, tf.constant(ABORT, tf.int64))
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


# Steps of a lean closure between its reads of the chief's stop request (lean_loop): a stop mid-block
# ends it at most this many steps later, on every worker at the same step.
STOP_EVERY = 8

# Per step of a lean closure's packed result: [j, epoch, index, hit] as worker_loop's, then the mean
# loss's float32 bits, whether every mean was finite, whether a stop was seen (chief/step/block_results.py).
LEAN_COLUMNS = 7


def lean_loop(strategy, replica, source, expected, readahead, dense, stopping):
    """The traced worker loop of the hybrid step with no ps on a step's path (a model without row-sparse
    tables): `worker_fn(iterator, first, count, slot, positions)` as `worker_loop`'s. Per step: read the
    examples, take the slot's step on this worker's copies and exchange the dense gradients, the loss
    and the chief's stop request among the workers (worker/replica/allreduce.py `lean_step`), then
    update the copies unless a mean was not finite or a worker saw the stop: every worker decides the
    same from the same exchanged values, so all end at the same step. No gate, no push: the chief moves
    the ps's step, loss and copies once the block's closures returned.

    The stop request (`stopping`, a bool variable on the ps) is read once per `STOP_EVERY` steps, in an
    outer loop around theirs: a variable read of another task inside a loop splits the loop between
    the two tasks, which then trade its control every iteration (on the dense 1 M model on loopback,
    a round trip to the ps and about 2 ms per step). Returns the worker, then LEAN_COLUMNS int64 per step run."""

    @tf.function(autograph=False)
    def worker_fn(iterator, first, count, slot, positions):
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        read = reader(source, expected, readahead, iterator, slot, positions)

        def steps(i, go, rows, stop):
            step = first + tf.cast(i, tf.int64)
            batch, hit, where = read(i, step)

            def replica_fn(batch, stop):
                graph = tf.compat.v1.get_default_graph()
                made = len(graph.get_operations())
                loss, means, finite, stopped = lean_step(replica, dense, batch, step, slot, stop)
                with tf.control_dependencies(stateful_since(graph, made)):  # as worker_loop's pushes
                    go = tf.logical_and(finite, tf.logical_not(stopped))
                return loss, means, finite, stopped, go

            loss, means, finite, stopped, go = strategy.run(replica_fn, args=(batch, stop))
            update = lambda: tf.identity(strategy.run(dense.apply, args=(step, means)) > 0)  # noqa: E731
            updated = tf.cond(go, update, lambda: tf.constant(False))
            bits = tf.cast(tf.bitcast(tf.cast(loss, tf.float32), tf.int32), tf.int64)
            flags = tf.cast(tf.stack([finite, stopped]), tf.int64)
            row = tf.concat([tf.cast(where, tf.int64), [tf.cast(hit, tf.int64), bits], flags], 0)
            with tf.control_dependencies([updated]):  # the next step reads the copies once updated
                return i + 1, tf.identity(go), rows.write(i, row)

        def chunk(i, go, rows):  # up to STOP_EVERY steps on one read of the stop request
            stop = tf.cast(stopping.read_value(), tf.float32)
            end = tf.minimum(i + STOP_EVERY, count)
            return tf.while_loop(
                lambda i, go, _: tf.logical_and(i < end, go),
                lambda i, go, rows: steps(i, go, rows, stop),
                (i, go, rows),
                parallel_iterations=1,
            )

        with dense.hyperparameters_read_once():
            _, _, rows = tf.while_loop(
                lambda i, go, _: tf.logical_and(i < count, go),
                chunk,
                (tf.constant(0, tf.int32), tf.constant(True), tf.TensorArray(tf.int64, 0, True)),
                parallel_iterations=1,
            )
        return tf.concat([[tf.cast(worker, tf.int64)], tf.reshape(rows.stack(), [-1])], 0)

    return worker_fn
