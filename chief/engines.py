"""Two ways to run one synchronous step: on the cluster, or in this process (the reference).

Both take the same (step, slot) data, start from the same weights and average the same per-slot
gradients, so a cluster run and a standalone run end with the same model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from chief.aggregator import SyncReplicasAggregator
from chief.data import slot_indices
from chief.jobs import Job
from chief.model_state import build_state, dense_gradients
from chief.sharding import partitioner
from chief.sources import Source, explain_worker_error
from cluster.config import TrainConfig


class StepInterrupted(Exception):
    """A stop was requested while the step waited for gradients; nothing of the step was applied."""

    def __init__(self, step: int):
        super().__init__(f"interrupted during step {step}")
        self.step = step


@dataclass
class StepResult:
    loss: float
    aggregated: int  # gradients averaged into this step
    stale_dropped: int  # surplus gradients (backup replicas) dropped since the previous step
    workers: list[int] = field(default_factory=list)  # workers whose gradients were applied
    timing: dict[str, float] = field(default_factory=dict)  # seconds per phase of the step
    applied: bool = True  # False when the loss was not finite: the update was withheld


class LocalEngine:
    """One process, no cluster: the reference every cluster run must match."""

    def __init__(self, job: Job, train: TrainConfig, source: Source, weights, sample):
        self.train = train
        self.source = source
        self.state = build_state(job, weights, sample)
        self._step_fn = self._build_step(job)

    def prepare(self, start_step: int) -> None:
        pass

    def _build_step(self, job: Job):
        model, optimizer, global_step = self.state.model, self.state.optimizer, self.state.global_step
        slots = self.train.replicas_to_aggregate

        @tf.function
        def step_fn(step, xs, ys):
            variables = model.trainable_variables
            per_slot, losses = [], []
            for k in range(slots):
                with tf.GradientTape() as tape:
                    loss = job.loss_fn(ys[k], model(xs[k], training=True))
                per_slot.append(dense_gradients(tape.gradient(loss, variables), variables))
                losses.append(tf.cast(loss, tf.float32))
            mean = [tf.add_n(list(gs)) / tf.cast(slots, gs[0].dtype) for gs in zip(*per_slot, strict=True)]
            loss = tf.add_n(losses) / slots

            def apply():
                optimizer.apply_gradients(zip(mean, variables, strict=True))
                global_step.assign(step + 1)
                return tf.constant(True)

            applied = tf.cond(tf.math.is_finite(loss), apply, lambda: tf.constant(False))
            return loss, applied

        return step_fn

    def step(self, step: int, interrupted: Callable[[], bool] = lambda: False) -> StepResult:
        t = self.train
        # The same source and positions as the workers read: per slot a (features, labels) nest.
        batches = [
            self.source.read_local(
                slot_indices(self.source.num_examples, t.seed, step, k, t.slot_batch_size, t.total_num_replicas, t.shuffle)
            )
            for k in range(t.replicas_to_aggregate)
        ]
        xs, ys = [b[0] for b in batches], [b[1] for b in batches]
        loss, applied = self._step_fn(tf.constant(step, tf.int64), xs, ys)
        return StepResult(float(loss), t.replicas_to_aggregate, stale_dropped=0, applied=bool(applied))

    def close(self) -> int:
        return 0


class ClusterEngine:
    """ParameterServerStrategy + ClusterCoordinator, made synchronous by the aggregator."""

    def __init__(self, job: Job, train: TrainConfig, source: Source, weights, sample):
        self.train = train
        self.source = source
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        num_ps = resolver.cluster_spec().num_tasks("ps")
        self.strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner(num_ps))
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        with self.strategy.scope():
            self.state = build_state(job, weights, sample)
        self.workers = list(resolver.cluster_spec().as_dict().get("worker", []))
        self.job = job
        self._fetchers = futures.ThreadPoolExecutor(max_workers=4 * train.total_num_replicas + 4)
        self._late: set[futures.Future] = set()

    def prepare(self, start_step: int) -> None:
        """Accumulators, the per-worker data and the traced functions, for a run starting at `start_step`."""
        self.aggregator = SyncReplicasAggregator(
            self.state.model.trainable_variables,
            required=self.train.replicas_to_aggregate,
            total_slots=self.train.total_num_replicas,
            start_step=start_step,
        )
        # Each worker builds its own source (chief/sources.py); closures read their slot's examples from it.
        self._expected = self.source.fingerprint()
        self._iterator = iter(self.coordinator.create_per_worker_dataset(self.source.dataset_fn))
        self._worker_fn = self._build_worker_fn()
        self._apply_fn = self._build_apply_fn()

    def _build_worker_fn(self):
        model, global_step, aggregator, job = self.state.model, self.state.global_step, self.aggregator, self.job
        strategy, source, expected = self.strategy, self.source, self._expected
        backups = self.train.total_num_replicas > self.train.replicas_to_aggregate

        @tf.function
        def worker_fn(iterator, step, slot, indices):
            x, y = source.worker_batch(next(iterator), indices, expected)

            def replica_fn(x, y):
                def compute():
                    variables = model.trainable_variables
                    with tf.GradientTape() as tape:
                        loss = job.loss_fn(y, model(x, training=True))
                    aggregator.push(slot, step, dense_gradients(tape.gradient(loss, variables), variables))
                    return tf.cast(loss, tf.float32), tf.constant(True)

                if not backups:  # every closure's step is current: no check, no branch
                    return compute()

                def skip():  # a backup replica whose step is already applied: no work to do
                    return tf.constant(math.nan, tf.float32), tf.constant(False)

                return tf.cond(tf.equal(global_step.read_value(), step), compute, skip)

            loss, computed = strategy.run(replica_fn, args=(x, y))
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            # One packed result: each output of a closure costs the chief its own fetch RPC.
            return tf.stack([tf.cast(worker, tf.float32), loss, tf.cast(computed, tf.float32)])

        return worker_fn

    def _build_apply_fn(self):
        model, optimizer, global_step, aggregator = (
            self.state.model,
            self.state.optimizer,
            self.state.global_step,
            self.aggregator,
        )

        @tf.function
        def apply_fn(step, chosen):
            grads = aggregator.take_mean(step, chosen)
            # The mean is already the cross-replica gradient. Left on, the optimizer's aggregation
            # (an identity outside a replica context) placed a copy of every gradient on the chief:
            # the whole model ps -> chief -> ps each step, 53 -> 13 ms of apply at 10 M parameters.
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True), experimental_aggregate_gradients=False)
            global_step.assign(step + 1)

        return apply_fn

    def step(self, step: int, interrupted: Callable[[], bool] = lambda: False) -> StepResult:
        """Run one synchronous step; raises StepInterrupted (nothing applied) if asked to stop mid-step."""
        try:
            return self._step(step, interrupted)
        except tf.errors.OpError as e:  # a worker's data missing or different: one line naming it
            raise (explain_worker_error(e, self.workers) or e) from None

    def _step(self, step: int, interrupted: Callable[[], bool]) -> StepResult:
        t = self.train
        t0 = time.perf_counter()
        step_t = tf.constant(step, tf.int64)
        pending: dict[futures.Future, int] = {}
        for slot in range(t.total_num_replicas):
            # A tensor made here, not a NumPy array: converting inside the closure would copy it to the
            # worker while holding the GIL, freezing the chief whenever that worker is slow or stopped.
            indices = tf.constant(
                slot_indices(self.source.num_examples, t.seed, step, slot, t.slot_batch_size, t.total_num_replicas, t.shuffle)
            )
            remote = self.coordinator.schedule(self._worker_fn, args=(self._iterator, step_t, slot, indices))
            pending[self._fetchers.submit(remote.fetch)] = slot
        t1 = time.perf_counter()
        chosen: dict[int, tuple[int, float]] = {}
        t_first = t1
        waiting = set(pending)
        while waiting and len(chosen) < t.replicas_to_aggregate:
            # Short waits so a stop request is honoured even while a worker stalls the step.
            done, waiting = futures.wait(waiting, timeout=0.25, return_when=futures.FIRST_COMPLETED)
            for future in done:
                worker, loss, computed = future.result()
                if computed == 1.0 and len(chosen) < t.replicas_to_aggregate:
                    chosen[pending[future]] = (int(worker), float(loss))
                    if len(chosen) == 1:
                        t_first = time.perf_counter()
            if len(chosen) < t.replicas_to_aggregate and interrupted():
                self._late.update(waiting)
                raise StepInterrupted(step)
        if len(chosen) < t.replicas_to_aggregate:
            raise RuntimeError(f"step {step}: only {len(chosen)} of {t.replicas_to_aggregate} gradients were computed")
        t2 = time.perf_counter()
        loss = float(np.mean([loss for _, loss in chosen.values()]))
        applied = math.isfinite(loss)
        if applied:
            mask = [slot in chosen for slot in range(t.total_num_replicas)]
            self._apply_fn(step_t, tf.constant(mask))
        t3 = time.perf_counter()
        self._late.update(f for f in pending if pending[f] not in chosen)
        return StepResult(
            loss=loss,
            applied=applied,
            aggregated=len(chosen),
            stale_dropped=self._collect_late(),
            workers=sorted({worker for worker, _ in chosen.values()}),
            # first_gradient: pull, compute and push of the fastest replica; wait_for_n: the rest of the N.
            timing={"schedule": t1 - t0, "first_gradient": t_first - t1, "wait_for_n": t2 - t_first, "apply": t3 - t2},
        )

    def _collect_late(self, wait_s: float = 0.0) -> int:
        """Count surplus closures that have finished; their gradients were dropped, never applied."""
        if wait_s and self._late:
            futures.wait(self._late, timeout=wait_s)
        done = {f for f in self._late if f.done()}
        self._late -= done
        for f in done:
            f.result()  # a job error in a backup replica still surfaces
        return len(done)

    def close(self) -> int:
        """Wait briefly for surplus closures; returns how many more were dropped."""
        late = self._collect_late(wait_s=30.0)
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        return late
