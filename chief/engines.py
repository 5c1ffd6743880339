"""Two ways to run one synchronous step: on the cluster, or in this process (the reference).

Both take the same (step, slot) data, start from the same weights (the seed's, each computed where
its variable lives: chief/initial_values.py) and average the same per-slot gradients, so a cluster
run and a standalone run end with the same model.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import tensorflow as tf

from chief.aggregator import SyncReplicasAggregator
from chief.data import slot_indices
from chief.gradients import mean_of_slots, sparse_variables
from chief.initial_values import PS_INIT_MIN_BYTES
from chief.jobs import Job
from chief.model_state import ModelState, allow_loss_scaling_under_ps, build_state
from chief.readahead import ReadAhead, request_tag, schedule_order
from chief.replica import Replica, inspect_job, replica_step, state_variables
from chief.sharding import partitioner
from chief.sources import Source, explain_worker_error
from cluster.config import TrainConfig

log = logging.getLogger("pstrain.chief")


def training_cluster(cluster: dict) -> dict:
    """The tasks that train: TF_CONFIG's cluster without an `evaluator` (as Kubeflow may list one). The
    evaluator runs no TF server for the chief; left in, connecting to the cluster would wait for it."""
    return {job: tasks for job, tasks in cluster.items() if job != "evaluator"}


def training_resolver() -> tf.distribute.cluster_resolver.ClusterResolver:
    """TF_CONFIG's resolver, with only the training tasks in its cluster."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = tf.train.ClusterSpec(training_cluster(resolver.cluster_spec().as_dict()))
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type=resolver.task_type, task_id=resolver.task_id, rpc_layer=resolver.rpc_layer or "grpc"
    )


def inspected_replica(job: Job, state, train: TrainConfig, source: Source, sample_features) -> Replica:
    """The per-slot computation over this engine's model, once `inspect_job` accepts the job: row-sparse
    variables found by tracing the model on `sample_features`, state variables by the inspection."""
    sparse = tuple(sparse_variables(state.model, sample_features))
    found = inspect_job(job, train, first_batch(source, train), state.model, sparse)  # refuses a job that breaks the contract
    state_vars = state_variables(state.model, *found)
    return Replica(job, state.model, state.optimizer, state_vars, train.seed, train.replicas_to_aggregate, sparse)


def apply_step(optimizer, variables, state_vars, means) -> None:
    """Apply a step's mean gradients (the first len(variables) of `means`), then the mean state deltas.

    The mean is already the cross-replica gradient. Left on, the optimizer's aggregation (an identity
    outside a replica context) placed a copy of every gradient on the chief: the whole model
    ps -> chief -> ps each step, 53 -> 13 ms of apply at 10 M parameters.
    """
    grads, deltas = means[: len(variables)], means[len(variables) :]
    optimizer.apply_gradients(zip(grads, variables, strict=True), experimental_aggregate_gradients=False)
    for variable, delta in zip(state_vars, deltas, strict=True):
        variable.assign_add(delta)


def slot_positions(train: TrainConfig, num_examples: int, step: int, slot: int):
    """The positions of the examples behind gradient `slot` of `step` (chief/data.py)."""
    t = train
    return slot_indices(num_examples, t.seed, step, slot, t.slot_batch_size, t.total_num_replicas, t.shuffle)


def first_batch(source: Source, train: TrainConfig):
    """Step 0's first slot, read locally: what `inspect_job` checks the job on before training."""
    if source.streams:
        return source.first_batch()
    return source.read_local(slot_positions(train, source.num_examples, 0, 0))


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
    read_ahead: int | None = None  # applied gradients whose examples were read ahead (None: no read-ahead)
    epoch: int | None = None  # a stream's epoch at the step's first batch (None: read by position)
    reread: int | None = None  # a stream's applied batches read from a fresh pipeline (their worker was past them)


class Engine(Protocol):
    """How the training loop drives one way of running synchronous steps.

    Calls go in this order: construct -> `prepare(first_step)` once -> `step(k)` for k = first_step,
    first_step + 1, ... -> `close()` once. `state` (model, optimizer, global step) exists from
    construction on, so a checkpoint can be restored into it before `prepare`.

    After `step(k)` returns, step k was applied exactly once from `replicas_to_aggregate` gradients
    (or, with `applied=False`, withheld because its loss was not finite: no variable changed, but
    the chosen slots' gradients stay in the accumulators, so the caller must not step past it: it
    checkpoints and stops). After it
    raises `StepInterrupted`, nothing of step k was applied and the state is that after step k-1, so a
    checkpoint taken then resumes exactly. After any other exception the engine is unusable: the
    caller reports the error and exits, and a restarted chief resumes from the latest checkpoint.
    """

    state: ModelState

    def prepare(self, first_step: int) -> None:
        """Set up what depends on where the run starts (accumulators at `first_step`, per-worker data)."""

    def step(self, step: int, interrupted: Callable[[], bool] = lambda: False) -> StepResult:
        """Run step `step`. `interrupted` is polled while waiting for gradients; when it turns true the
        step is abandoned with StepInterrupted. An engine that never waits may ignore it."""

    def close(self) -> int:
        """End the run; returns how many more surplus (backup) gradients were dropped since the last step."""


class LocalEngine:
    """One process, no cluster: the reference every cluster run must match.

    Fulfils `Engine`: nothing to prepare (the whole step is one traced function), `step` never waits
    so it ignores `interrupted`, and there are no backup gradients to drop, so `close` returns 0.
    """

    def __init__(self, job: Job, train: TrainConfig, source: Source, sample):
        """`source`: the training examples (chief/sources.py); `sample`: one example's features."""
        self.train = train
        self.source = source
        self.state = build_state(job, train.seed, sample)
        self.replica = inspected_replica(job, self.state, train, source, sample)
        self.sparse = list(self.replica.sparse)
        self._step_fn = self._build_step()

    def prepare(self, start_step: int) -> None:
        if self.source.streams:  # the same stream as the workers', read here
            self.source.begin(start_step)
            self._stream = self.source.local_batches()

    def _build_step(self):
        replica, optimizer, global_step = self.replica, self.state.optimizer, self.state.global_step
        slots = self.train.replicas_to_aggregate

        @tf.function
        def step_fn(step, batches):
            variables = replica.model.trainable_variables
            per_slot, losses = [], []
            for k in range(slots):  # each slot from the same starting state, as on the cluster
                loss, grads, deltas = replica_step(replica, batches[k], step, k)
                per_slot.append(grads + deltas)
                losses.append(loss)
            mean = mean_of_slots(per_slot, slots)
            loss = tf.add_n(losses) / slots

            def apply():
                apply_step(optimizer, variables, replica.state_variables, mean)
                global_step.assign(step + 1)
                return tf.constant(True)

            applied = tf.cond(tf.math.is_finite(loss), apply, lambda: tf.constant(False))
            return loss, applied

        return step_fn

    def step(self, step: int, interrupted: Callable[[], bool] = lambda: False) -> StepResult:
        t = self.train
        epoch = None
        if self.source.streams:  # the step's M stream batches; backup slots' batches are skipped, as on the cluster
            read = [next(self._stream) for _ in range(t.total_num_replicas)]
            self.source.observe([where for where, _ in read])
            batches, epoch = [batch for _, batch in read[: t.replicas_to_aggregate]], self.source.epoch_of(step)
        else:  # the same source and positions as the workers read: per slot a (features, labels[, weights]) nest
            positions = [slot_positions(t, self.source.num_examples, step, k) for k in range(t.replicas_to_aggregate)]
            batches = [self.source.read_local(p) for p in positions]
        loss, applied = self._step_fn(tf.constant(step, tf.int64), batches)
        return StepResult(float(loss), t.replicas_to_aggregate, stale_dropped=0, applied=bool(applied), epoch=epoch)

    def close(self) -> int:
        return 0


class ClusterEngine:
    """ParameterServerStrategy + ClusterCoordinator, made synchronous by the aggregator."""

    def __init__(
        self,
        job: Job,
        train: TrainConfig,
        source: Source,
        sample,
        resolver=None,
        ps_init_min_bytes: int = PS_INIT_MIN_BYTES,
    ):
        """`source`: the training examples, built again on each worker (chief/sources.py); `sample`: one
        example's features; `resolver` names the cluster (default: TF_CONFIG's training tasks);
        variables of at least `ps_init_min_bytes` get their initial values on their ps (chief/initial_values.py)."""
        self.train = train
        self.source = source
        allow_loss_scaling_under_ps()
        resolver = resolver or training_resolver()
        num_ps = resolver.cluster_spec().num_tasks("ps")
        self.strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner(num_ps))
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        with self.strategy.scope():
            self.state = build_state(job, train.seed, sample, ps_init_min_bytes)
        self.workers = list(resolver.cluster_spec().as_dict().get("worker", []))
        self.job = job
        # Inspected on the training model itself: a lookup reads only its rows from the ps.
        self.replica = inspected_replica(job, self.state, train, source, sample)
        self.sparse = list(self.replica.sparse)
        self._fetchers = futures.ThreadPoolExecutor(max_workers=4 * train.total_num_replicas + 4)
        self._late: set[futures.Future] = set()
        self._finished: list[int] = []  # the last step's slots in the order their closures finished

    def prepare(self, start_step: int) -> None:
        """Accumulators, the per-worker data and the traced functions, for a run starting at `start_step`."""
        variables = self.state.model.trainable_variables
        if any(self.sparse):
            tables = {v.name.split("/part_")[0].split(":")[0] for v, rows in zip(variables, self.sparse, strict=True) if rows}
            log.info("row-sparse gradients (only touched rows move): %s", ", ".join(sorted(tables)))
        self.aggregator = SyncReplicasAggregator(
            [*variables, *self.replica.state_variables],
            required=self.train.replicas_to_aggregate,
            total_slots=self.train.total_num_replicas,
            start_step=start_step,
            sparse=[*self.sparse, *[False] * len(self.replica.state_variables)],
        )
        # Each worker builds its own source (chief/sources.py); closures read their slot's examples from it.
        if self.source.streams:
            self.source.begin(start_step)
        self._expected = self.source.fingerprint()
        t = self.train
        reads_ahead = self.source.reads_ahead and os.environ.get("PSTRAIN_READ_AHEAD", "1") != "0"
        self._readahead = ReadAhead(t.slot_batch_size, t.total_num_replicas) if reads_ahead else None
        dataset_fn = functools.partial(self.source.dataset_fn, self._readahead)
        self._iterator = iter(self.coordinator.create_per_worker_dataset(dataset_fn))
        self._worker_fn = self._build_worker_fn()
        self._apply_fn = self._build_apply_fn()

    def _build_worker_fn(self):
        global_step, aggregator, replica = self.state.global_step, self.aggregator, self.replica
        strategy, source, expected, readahead = self.strategy, self.source, self._expected, self._readahead
        backups = self.train.total_num_replicas > self.train.replicas_to_aggregate

        @tf.function
        def worker_fn(iterator, step, slot, indices, next_indices):
            where = tf.constant([-1, -1, -1], tf.int64)
            if source.streams:  # [j, epoch, batch in epoch], and whether it was read from a fresh pipeline
                batch, where, hit = source.worker_batch(iterator, step, slot, expected)
            elif readahead is None:
                batch, hit = source.worker_batch(next(iterator), indices, expected)
            else:  # ask for the next step's examples first: the pipeline then never waits on this closure
                tag = request_tag(step, slot, readahead.total_slots)
                with tf.control_dependencies([readahead.request(tag + readahead.total_slots, next_indices)]):
                    element = next(iterator)
                batch, hit = source.worker_batch(element, indices, expected, tag)

            def replica_fn(batch):
                def compute():
                    loss, grads, deltas = replica_step(replica, batch, step, slot)
                    # Sparse pushes are not stateful ops: without this dependency they would be pruned.
                    with tf.control_dependencies(aggregator.push(slot, step, grads + deltas)):
                        return tf.identity(loss), tf.constant(True)

                if not backups:  # every closure's step is current: no check, no branch
                    return compute()

                def skip():  # a backup replica whose step is already applied: no work to do
                    return tf.constant(math.nan, tf.float32), tf.constant(False)

                return tf.cond(tf.equal(global_step.read_value(), step), compute, skip)

            loss, computed = strategy.run(replica_fn, args=(batch,))
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            # One packed result: each output of a closure costs the chief its own fetch RPC (float64: exact positions).
            head = [tf.cast(x, tf.float64) for x in (worker, loss, computed, hit)]
            return tf.concat([tf.stack(head), tf.cast(where, tf.float64)], 0)

        return worker_fn

    def _build_apply_fn(self):
        replica, optimizer, global_step, aggregator = self.replica, self.state.optimizer, self.state.global_step, self.aggregator

        @tf.function
        def apply_fn(step, chosen):
            means = aggregator.take_mean(step, chosen)
            apply_step(optimizer, replica.model.trainable_variables, replica.state_variables, means)
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
        streams, num = self.source.streams, getattr(self.source, "num_examples", 0)
        # A stream: slots in ascending order, so a worker that takes two of a step's closures (from the
        # FIFO queue) takes them in stream order and reads both forward (chief/streams.py).
        order = range(t.total_num_replicas) if streams else schedule_order(self._finished, t.total_num_replicas)
        for slot in order:
            # Tensors made here, not NumPy arrays: converting inside the closure would copy them to the
            # worker while holding the GIL, freezing the chief whenever that worker is slow or stopped.
            indices = tf.zeros([t.slot_batch_size], tf.int64) if streams else tf.constant(slot_positions(t, num, step, slot))
            # The next step's positions for this slot, which the worker reads ahead (sources that read files).
            ahead = tf.constant(slot_positions(t, num, step + 1, slot)) if self._readahead else indices
            remote = self.coordinator.schedule(self._worker_fn, args=(self._iterator, step_t, slot, indices, ahead))
            pending[self._fetchers.submit(remote.fetch)] = slot
        t1 = time.perf_counter()
        chosen: dict[int, tuple[int, float]] = {}
        self._finished, hits, read = [], 0, []
        t_first = t1
        waiting = set(pending)
        while waiting and len(chosen) < t.replicas_to_aggregate:
            # Short waits so a stop request is honoured even while a worker stalls the step.
            done, waiting = futures.wait(waiting, timeout=0.25, return_when=futures.FIRST_COMPLETED)
            for future in done:
                worker, loss, computed, hit, *where = future.result()
                self._finished.append(pending[future])
                if computed == 1.0 and len(chosen) < t.replicas_to_aggregate:
                    chosen[pending[future]] = (int(worker), float(loss))
                    hits += int(hit)
                    read.append(where)
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
        if streams:
            self.source.observe(read)
        return StepResult(
            loss=loss,
            applied=applied,
            aggregated=len(chosen),
            stale_dropped=self._collect_late(),
            workers=sorted({worker for worker, _ in chosen.values()}),
            read_ahead=hits if self._readahead else None,
            epoch=self.source.epoch_of(step) if streams else None,
            reread=hits if streams else None,
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
