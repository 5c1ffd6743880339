"""The step gate on the ps: closures wait there between steps, the apply opens the next step.

TF1's SyncReplicasOptimizer made workers take a token from a queue on the ps before each step, one
token per replica, so a worker that took one and died left the others waiting forever. Here the
gate is a token that nobody keeps: two FIFO queues on the ps, one per step parity, and the open
step's queue holds one token whose value is that step. A closure waiting for step s *peeks*: it
dequeues the token from queue s % 2 and enqueues it again in the same ps-side function, so any
number of closures pass (and a closure that ClusterCoordinator re-runs finds the token again).
The apply of step s closes gate s (takes its token) and opens s + 1 (puts s + 1 in the other queue).

A closure first reads the global step and does not wait at all when step s is already open or
applied; it waits only while step s - 1 is unapplied. `ABORT`, put in both queues when a block ends
early (a non-finite step, an interrupt), lets every waiting closure through with nothing to do.
"""

from __future__ import annotations

import uuid

import tensorflow as tf

ABORT = -1  # the token that ends a block: closures stop there


class StepGate:
    """Two parity queues of int64 tokens, on `device` (the global step's ps)."""

    def __init__(self, device: str):
        self.device = device
        tag = uuid.uuid4().hex[:8]  # fresh for every chief incarnation
        self.names = (f"pstrain_{tag}_gate0", f"pstrain_{tag}_gate1")

    def _queue(self, parity: int) -> tf.Tensor:
        """The queue of `parity`, created in the current function under its shared name."""
        return tf.raw_ops.FIFOQueueV2(component_types=[tf.int64], shapes=[[]], capacity=-1, shared_name=self.names[parity])

    def _by_parity(self, step: tf.Tensor, fn) -> tf.Tensor:
        return tf.cond(tf.equal(step % 2, 0), lambda: fn(0), lambda: fn(1))

    def _peek(self, parity: int) -> tf.Tensor:
        queue = self._queue(parity)
        token = tf.reshape(tf.raw_ops.QueueDequeueV2(handle=queue, component_types=[tf.int64])[0], [])
        with tf.control_dependencies([tf.raw_ops.QueueEnqueueV2(handle=queue, components=[token])]):
            return tf.identity(token)

    def wait(self, step: tf.Tensor, global_step: tf.Variable) -> tf.Tensor:
        """In a closure: block until step `step` is open. Returns the open step as seen (`step`: compute
        it; greater: it was applied without this slot; `ABORT`: the block ended early)."""
        with tf.device(self.device):
            current = global_step.read_value()
            return tf.cond(current >= step, lambda: current, lambda: self._by_parity(step, self._peek))

    def advance(self, step: tf.Tensor) -> tf.Tensor:
        """In the apply, after step `step` was applied and the global step moved: close it, open step + 1."""
        with tf.device(self.device):

            def close(parity: int) -> tf.Tensor:
                return tf.reshape(tf.raw_ops.QueueDequeueV2(handle=self._queue(parity), component_types=[tf.int64])[0], [])

            closed = self._by_parity(step, close)
            with tf.control_dependencies([closed]):
                return self.open(step + 1)

    def open(self, step: tf.Tensor) -> tf.Tensor:
        """Put the token of `step` in its queue (the first step of a run, and `advance`)."""
        with tf.device(self.device):

            def put(parity: int) -> tf.Tensor:
                with tf.control_dependencies([tf.raw_ops.QueueEnqueueV2(handle=self._queue(parity), components=[step])]):
                    return tf.identity(step)

            return self._by_parity(step, put)

    def abort(self) -> tf.Tensor:
        """Let every closure through with `ABORT`: the block ends without the steps still waiting."""
        with tf.device(self.device):
            token = tf.constant(ABORT, tf.int64)
            puts = [tf.raw_ops.QueueEnqueueV2(handle=self._queue(parity), components=[token]) for parity in (0, 1)]
            with tf.control_dependencies(puts):
                return tf.identity(token)
