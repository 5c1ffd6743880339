"""LocalEngine: one process, no cluster, the reference every cluster run must match (chief/step/engine.py)."""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from chief.contract.framework import trainable_of
from chief.contract.job import Job, job_file
from chief.state.model_state import build_state
from chief.step.engine import StepResult, first_nonfinite, inspected_replica, slot_positions, value_names
from chief.step.rounding import same_rounding_everywhere
from cluster.config import TrainConfig
from cluster.errors import user_error
from worker.input.sources import Source
from worker.ps.apply import all_finite, apply_step
from worker.replica.gradients import mean_of_slots
from worker.replica.replica import replica_step


class LocalEngine:
    """One process, no cluster: the reference every cluster run must match.

    Fulfils `Engine`: nothing to prepare (each step is one traced function), `run` never waits so it
    ignores `interrupted`, and there are no backup gradients to drop, so `close` returns 0.
    """

    def __init__(self, job: Job, train: TrainConfig, source: Source, sample):
        """`source`: the training examples (worker/input/sources.py); `sample`: one example's features."""
        same_rounding_everywhere()  # as on the cluster
        self.train, self.job_spec = train, job.spec
        self.source = source
        self.state = build_state(job, train.seed, sample)
        self.replica = inspected_replica(job, self.state, train, source, sample)
        self.sparse = list(self.replica.sparse)
        self.names = value_names(self.replica)
        self._step_fn = self._build_step()

    def prepare(self, start_step: int) -> None:
        if self.source.streams:  # the same stream as the workers', read here
            self.source.begin(start_step)
            self._stream = self.source.local_batches()

    def _build_step(self):
        replica, optimizer, global_step = self.replica, self.state.optimizer, self.state.global_step
        slots, skip = self.train.replicas_to_aggregate, self.train.on_nonfinite == "skip"

        @tf.function(autograph=False)  # as the cluster's (chief/contract/as_written.py)
        def step_fn(step, batches):
            variables = trainable_of(replica.model)
            per_slot = []
            for k in range(slots):  # each slot from the same starting state, as on the cluster
                loss, grads, deltas = replica_step(replica, batches[k], step, k)
                per_slot.append([loss, *grads, *deltas])
            means = mean_of_slots(per_slot, slots)  # in slot order, as the cluster's apply adds them
            finite = all_finite(means)

            def apply():
                apply_step(optimizer, variables, replica.state_variables, means[1:])
                return tf.constant(True)

            applied = tf.cond(tf.reduce_all(finite), apply, lambda: tf.constant(False))
            if skip:
                global_step.assign(step + 1)
            else:
                global_step.assign(tf.where(applied, step + 1, step))
            return means[0], applied, finite

        return step_fn

    def run(self, first: int, count: int, interrupted: Callable[[], bool] = lambda: False) -> list[StepResult]:
        t, results = self.train, []
        for step in range(first, first + count):
            epoch = None
            if self.source.streams:  # the step's M stream batches; backup slots' batches are skipped, as on the cluster
                read = [next(self._stream) for _ in range(t.total_num_replicas)]
                self.source.observe([where for where, _ in read])
                batches, epoch = [batch for _, batch in read[: t.replicas_to_aggregate]], self.source.epoch_of(step)
            else:  # the same source and positions as the workers read: per slot a (features, labels[, weights]) nest
                positions = [slot_positions(t, self.source.num_examples, step, k) for k in range(t.replicas_to_aggregate)]
                batches = [self.source.read_local(p) for p in positions]
            try:
                loss, applied, finite = self._step_fn(tf.constant(step, tf.int64), batches)
            except tf.errors.OpError as e:  # e.g. a tf.debugging assertion in the job's model
                if (found := user_error(e, job_file(self.job_spec), step)) is None:
                    raise
                raise found from e
            bad = first_nonfinite(finite.numpy().tolist(), self.names)
            results.append(StepResult(float(loss), t.replicas_to_aggregate, 0, applied=bool(applied), nonfinite=bad, epoch=epoch))
            if bad and t.on_nonfinite == "stop":
                break
        return results

    def close(self) -> int:
        return 0
