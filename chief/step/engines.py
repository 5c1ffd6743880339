"""Two ways to run one synchronous step: on the cluster, or in this process (the reference).

Both take the same (step, slot) data, start from the same weights (the seed's, each computed where
its variable lives: chief/state/initial_values.py) and average the same per-slot gradients, so a cluster
run and a standalone run end with the same model.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import tensorflow as tf

from chief.data.positions import slot_indices
from chief.data.readahead import ReadAhead, request_tag, schedule_order
from chief.data.sources import Source, explain_worker_error
from chief.job import Job, job_file
from chief.state.initial_values import PS_INIT_MIN_BYTES
from chief.state.model_state import ModelState, allow_loss_scaling_under_ps, build_state, variables_of
from chief.state.sharding import partitioner
from chief.step.aggregator import SyncReplicasAggregator
from chief.step.clipping import apply_clipped
from chief.step.gate import ABORT, StepGate
from chief.step.gradients import all_finite, mean_of_slots, sparse_variables
from chief.step.replica import Replica, assigned_state_variables, inspect_job, replica_step
from chief.step.rounding import same_rounding_everywhere
from cluster.config import TrainConfig
from cluster.errors import user_error

log = logging.getLogger("pstrain.chief")
STALL_MIN_S = 10.0  # a block whose global step has not moved this long (and STALL_STEPS fast steps) is ended
STALL_STEPS = 20


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
    state_vars = assigned_state_variables(state.model, *found)
    return Replica(job, state.model, state.optimizer, state_vars, train.seed, train.replicas_to_aggregate, sparse)


def apply_step(optimizer, variables, state_vars, means) -> None:
    """Apply a step's mean gradients (the first len(variables) of `means`, clipped per whole variable
    as one process clips: chief/step/clipping.py), then the mean state deltas."""
    grads, deltas = means[: len(variables)], means[len(variables) :]
    apply_clipped(optimizer, grads, variables)
    for variable, delta in zip(state_vars, deltas, strict=True):
        variable.assign_add(delta)


def apply_widths(slots: int, values: int) -> tuple[int, ...]:
    """Columns per step of the apply's packed result: loss, chosen slots, their workers, late, finite, applied."""
    return (1, slots, slots, 1, values, 1)


def unpack_applied(packed: np.ndarray, widths: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """The apply's [steps, sum(widths)] float64 result as (losses, chosen, workers, late, finite, proceeded)."""
    losses, chosen, workers, late, finite, proceeded = np.split(packed, np.cumsum(widths)[:-1], axis=1)
    return (
        losses[:, 0].astype(np.float32),
        chosen.astype(bool),
        workers.astype(np.int64),
        late[:, 0].astype(np.int64),
        finite.astype(bool),
        proceeded[:, 0].astype(bool),
    )


def slot_positions(train: TrainConfig, num_examples: int, step: int, slot: int):
    """The positions of the examples behind gradient `slot` of `step` (chief/data/positions.py)."""
    t = train
    return slot_indices(num_examples, t.seed, step, slot, t.slot_batch_size, t.total_num_replicas, t.shuffle)


def first_batch(source: Source, train: TrainConfig):
    """Step 0's first slot, read locally: what `inspect_job` checks the job on before training."""
    if source.streams:
        return source.first_batch()
    return source.read_local(slot_positions(train, source.num_examples, 0, 0))


@dataclass
class StepResult:
    loss: float  # the mean of the applied slots' losses
    aggregated: int  # gradients averaged into this step
    stale_dropped: int  # gradients computed for an earlier step but pushed after it was applied (backup replicas)
    workers: list[int] = field(default_factory=list)  # workers whose gradients were applied
    timing: dict[str, float] = field(default_factory=dict)  # seconds per phase of the step's block
    applied: bool = True  # False: a value was not finite, the update was withheld (see `nonfinite`)
    nonfinite: str | None = None  # the first of "loss" and the variables whose mean was not finite
    read_ahead: int | None = None  # applied gradients whose examples were read ahead (None: no read-ahead)
    epoch: int | None = None  # a stream's epoch at the step's first batch (None: read by position)
    reread: int | None = None  # a stream's applied batches read from a fresh pipeline (their worker was past them)


class Engine(Protocol):
    """How the training loop drives one way of running synchronous steps.

    Calls go in this order: construct -> `prepare(first_step)` once -> `run(first, count)` for
    consecutive blocks of steps -> `close()` once. `state` (model, optimizer, global step) exists from
    construction on, so a checkpoint can be restored into it before `prepare`.

    `run(first, count)` returns one result per step it got to, in order. Each applied step was
    applied exactly once from `replicas_to_aggregate` gradients. A step whose loss, mean gradient or
    mean state delta was not finite is withheld (`applied=False`, no variable changed): with
    `on_nonfinite = "stop"` it is the last result; with "skip" the block goes on past it. Fewer
    results than `count` without a withheld step means `interrupted()` turned true: the steps not
    returned were not applied, so a checkpoint taken then resumes exactly. After an exception the
    engine is unusable: the caller reports the error and exits, and a restarted chief resumes from
    the latest checkpoint.
    """

    state: ModelState

    def prepare(self, first_step: int) -> None:
        """Set up what depends on where the run starts (accumulators at `first_step`, per-worker data)."""

    def run(self, first: int, count: int, interrupted: Callable[[], bool] = lambda: False) -> list[StepResult]:
        """Run steps first..first+count-1. `interrupted` is polled while the steps run; when it turns
        true the engine stops at the next step boundary. An engine that never waits may ignore it."""

    def close(self) -> int:
        """End the run; returns how many more late (backup) gradients were dropped since the last step."""


def first_nonfinite(finite: Sequence[bool], names: Sequence[str]) -> str | None:
    """The name of the first value that was not finite (`finite` and `names` in the same order), or None."""
    return next((name for ok, name in zip(finite, names, strict=True) if not ok), None)


class LocalEngine:
    """One process, no cluster: the reference every cluster run must match.

    Fulfils `Engine`: nothing to prepare (each step is one traced function), `run` never waits so it
    ignores `interrupted`, and there are no backup gradients to drop, so `close` returns 0.
    """

    def __init__(self, job: Job, train: TrainConfig, source: Source, sample):
        """`source`: the training examples (chief/data/sources.py); `sample`: one example's features."""
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

        @tf.function(autograph=False)  # as the cluster's (chief/job.py: as_written)
        def step_fn(step, batches):
            variables = replica.model.trainable_variables
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


def value_names(replica: Replica) -> list[str]:
    """What a step averages, in order: the loss, each trainable variable, each state variable."""
    variables = [*replica.model.trainable_variables, *replica.state_variables]
    return ["loss", *(v.name.split(":")[0] for v in variables)]


class ClusterEngine:
    """ParameterServerStrategy + ClusterCoordinator, made synchronous by the aggregator.

    A block of K steps costs the chief one dispatch: each slot's closure runs the K steps in one
    in-graph loop on its worker, waiting at the step gate on the ps between steps (chief/step/gate.py),
    while one function that the chief calls once per block takes each step's N gradients, applies
    them on the ps and opens the next step (TF1's chief queue runner, without Python per step).
    """

    def __init__(
        self,
        job: Job,
        train: TrainConfig,
        source: Source,
        sample,
        resolver=None,
        ps_init_min_bytes: int = PS_INIT_MIN_BYTES,
    ):
        """`source`: the training examples, built again on each worker (chief/data/sources.py); `sample`: one
        example's features; `resolver` names the cluster (default: TF_CONFIG's training tasks);
        variables of at least `ps_init_min_bytes` get their initial values on their ps (chief/state/initial_values.py)."""
        self.train = train
        self.source = source
        same_rounding_everywhere()  # as in the standalone reference
        allow_loss_scaling_under_ps()
        resolver = resolver or training_resolver()
        num_ps = resolver.cluster_spec().num_tasks("ps")
        self.strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner(num_ps))
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        with self.strategy.scope():
            self.state = build_state(job, train.seed, sample, ps_init_min_bytes)
            # Each slot's loss is averaged like a gradient: the apply checks it before applying.
            self.loss = tf.Variable(0.0, trainable=False, name="pstrain_step_loss")
        self.workers = list(resolver.cluster_spec().as_dict().get("worker", []))
        self.job = job
        # Inspected on the training model itself: a lookup reads only its rows from the ps.
        self.replica = inspected_replica(job, self.state, train, source, sample)
        self.sparse = list(self.replica.sparse)
        self.names = value_names(self.replica)
        self._fetchers = futures.ThreadPoolExecutor(max_workers=2 * train.total_num_replicas + 4)
        self._late: set[futures.Future] = set()
        self._finished: list[int] = []  # the last block's slots in the order their closures finished
        self._step_s = 1.0  # the fastest step seen (seconds): how long a block may go without progress

    def prepare(self, start_step: int) -> None:
        """Accumulators, the step gate, the per-worker data and the traced functions, for a run starting
        at `start_step`."""
        variables = self.state.model.trainable_variables
        if any(self.sparse):
            tables = {v.name.split("/part_")[0].split(":")[0] for v, rows in zip(variables, self.sparse, strict=True) if rows}
            log.info("row-sparse gradients (only touched rows move): %s", ", ".join(sorted(tables)))
        device = self.state.global_step.device
        self.aggregator = SyncReplicasAggregator(
            [self.loss, *variables, *self.replica.state_variables],
            required=self.train.replicas_to_aggregate,
            total_slots=self.train.total_num_replicas,
            start_step=start_step,
            sparse=[False, *self.sparse, *[False] * len(self.replica.state_variables)],
            arrivals_device=device,
        )
        self.gate = StepGate(device)
        tf.function(self.gate.open, autograph=False)(tf.constant(start_step, tf.int64))
        if self.train.total_num_replicas > len(self.workers) and self.train.steps_per_execution > 1:
            log.info(
                "%d replica slots on %d workers: one step per dispatch (a block's closures must all run at once)",
                self.train.total_num_replicas,
                len(self.workers),
            )
        # Each worker builds its own source (chief/data/sources.py); closures read their slot's examples from it.
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
        self._unblock_fn = tf.function(self.aggregator.unblock, autograph=False)
        one_ps = len({v.device for v in variables_of(self.state.model.weights)} | {device}) == 1
        self._apply_device = device if one_ps else None
        self._warm = False

    def _build_worker_fn(self):
        global_step, aggregator, replica, gate = self.state.global_step, self.aggregator, self.replica, self.gate
        strategy, source, expected, readahead = self.strategy, self.source, self._expected, self._readahead
        backups = self.train.total_num_replicas > self.train.replicas_to_aggregate

        @tf.function(autograph=False)  # the job's code is converted where it is called (chief/job.py: as_written)
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

    def _build_apply_fn(self):
        replica, optimizer, global_step = self.replica, self.state.optimizer, self.state.global_step
        aggregator, gate, loss_var = self.aggregator, self.gate, self.loss
        skip = self.train.on_nonfinite == "skip"
        with tf.device(global_step.device):
            self._stopping = tf.Variable(False, trainable=False, name="pstrain_stopping")
        stopping = self._stopping
        widths = self._apply_widths = apply_widths(self.train.total_num_replicas, len(self.names))

        @tf.function(autograph=False)
        def apply_means(means):
            """One step's update; as a function call it has finished, every write done, when it returns."""
            apply_step(optimizer, replica.model.trainable_variables, replica.state_variables, means)
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

    def run(self, first: int, count: int, interrupted: Callable[[], bool] = lambda: False) -> list[StepResult]:
        """Run steps first..first+count-1, in one dispatch when the engine is warm; see `Engine.run`. With
        more slots than workers a closure would wait at the gate for slots queued behind it on its own
        worker: then one step per dispatch, as the closures of a step can run one after another."""
        results: list[StepResult] = []
        try:
            start, end = first, first + count
            while start < end:
                # One step per dispatch while the engine is cold (the functions and per-worker data are made
                # during its first dispatch) and with more slots than workers; else the whole block.
                together = self._warm and self.train.total_num_replicas <= len(self.workers)
                size = end - start if together else 1
                block = self._run(start, size, interrupted)
                self._warm = True
                results += block
                start += len(block)
                withheld = self.train.on_nonfinite == "stop" and any(not r.applied for r in block)
                if len(block) < size or withheld or interrupted():
                    break  # interrupted, or a step withheld under "stop": the caller checkpoints and stops
        except tf.errors.OpError as e:  # a worker's data missing or different, or the job's code failing: one line
            error = self._cancelled_by(e) if isinstance(e, tf.errors.CancelledError) else e
            found = explain_worker_error(error, self.workers) or user_error(error, job_file(self.job.spec), self._open_step())
            if found is None:
                raise error from (None if error is e else e)
            raise found from error
        return results

    def _cancelled_by(self, error: tf.errors.CancelledError) -> tf.errors.OpError:
        """Why closures were cancelled. A worker's call to a ps that died (or came back without its
        variables) can end CANCELLED, not UNAVAILABLE, and ClusterCoordinator then cancels every closure:
        read the smallest variable on each ps; if one fails (or hangs for 30 s), an UnavailableError
        naming that ps (the chief then restarts and resumes from its checkpoint), else `error` itself."""
        smallest: dict[str, tf.Variable] = {}
        for variable in [self.state.global_step, *variables_of(self.state.model.weights)]:
            kept = smallest.get(variable.device)
            if kept is None or (variable.shape.num_elements() or 0) < (kept.shape.num_elements() or 0):
                smallest[variable.device] = variable
        for device, variable in smallest.items():
            read = self._fetchers.submit(variable.read_value)
            try:
                failed = read.exception(timeout=30.0)
            except futures.TimeoutError:
                failed = "no answer in 30s"
            if failed is not None:
                why = failed.message.splitlines()[0] if isinstance(failed, tf.errors.OpError) else str(failed)
                return tf.errors.UnavailableError(None, None, f"{device} failed after closures were cancelled: {why}")
        return error

    def _open_step(self) -> int | None:
        """The step the cluster was computing (the global step), for an error's message; None if unknown."""
        try:
            return int(self.state.global_step.numpy())
        except tf.errors.OpError:
            return None

    def _run(self, first: int, count: int, interrupted: Callable[[], bool]) -> list[StepResult]:
        t = self.train
        t0 = time.perf_counter()
        first_t, count_t = tf.constant(first, tf.int64), tf.constant(count, tf.int32)
        streams, num = self.source.streams, getattr(self.source, "num_examples", 0)
        # One shape of positions for every block up to K steps (rows past the block's are zeros): blocks cut
        # short by a checkpoint or an evaluation, and the cold engine's first one-step block, reuse the trace.
        rows, used = max(count, t.steps_per_execution) + 1, count + (1 if self._readahead else 0)
        # A stream: slots in ascending order, so a worker that takes two of a step's closures (one step per
        # dispatch) takes them in stream order and reads both forward (chief/data/streams.py).
        order = range(t.total_num_replicas) if streams else schedule_order(self._finished, t.total_num_replicas)
        pending: dict[futures.Future, int] = {}
        for slot in order:
            # Tensors made here, not NumPy arrays: converting inside the closure would copy them to the
            # worker while holding the GIL, freezing the chief whenever that worker is slow or stopped.
            # The slot is a Python int: a trace per slot pushes to its own accumulators directly (a
            # switch_case over slots, one trace for all, cost about a fifth more per step:
            # docs/benchmarks/2026-12-03-per-slot-traces.md).
            block = np.zeros([rows, t.slot_batch_size], np.int64)
            if not streams:
                block[:used] = [slot_positions(t, num, first + i, slot) for i in range(used)]
            positions = tf.constant(block)
            args = (self._iterator, first_t, count_t, slot, positions)
            remote = self.coordinator.schedule(self._worker_fn, args=args)
            pending[self._fetchers.submit(remote.fetch)] = slot
        t1 = time.perf_counter()
        self._finished, results = [], {}
        if count == 1 and not self._pushed(pending, results, interrupted):
            return []  # interrupted before the step's gradients were in: nothing applied
        applying = self._fetchers.submit(self._apply_block, first_t, count_t)
        stalled = self._wait(applying, pending, results, interrupted, can_stall=count > 1)
        losses, chosen, workers, late, finite, proceeded = unpack_applied(applying.result().numpy(), self._apply_widths)
        if stalled:  # the accumulators hold the unblocking pushes: start afresh from the global step
            self.prepare(int(self.state.global_step.numpy()))
        t2 = time.perf_counter()
        if not stalled and proceeded.all() and count > 1:
            self._step_s = min(self._step_s, (t2 - t1) / count)
        # Without backups every closure is in every step: wait for them all (they pushed the last step).
        if t.total_num_replicas == t.replicas_to_aggregate and not stalled:
            self._wait(None, {f: slot for f, slot in pending.items() if slot not in results}, results, interrupted)
        self._late.update(f for f in pending if pending[f] not in results)
        slot_worker = {slot: int(out[0]) for slot, out in results.items()}
        per_step = {slot: out[1:].reshape(-1, 4) for slot, out in results.items()}  # [j, epoch, index, hit] per step
        steps = []
        for i in np.flatnonzero(proceeded):
            picked = np.flatnonzero(chosen[i])
            # With backups the apply knows each chosen slot's worker; else the closures said.
            found = {int(workers[i][s]) if workers[i][s] >= 0 else slot_worker.get(int(s), -1) for s in picked}
            bad = first_nonfinite(finite[i].tolist(), self.names)
            # The chosen slots' [j, epoch, index, hit] rows of this step (a closure's rows start at `first`).
            read = [per_step[s][i] for s in picked if s in per_step and i < len(per_step[s])]
            hits = int(sum(r[3] for r in read))
            epoch = reread = None
            if streams:  # their batches' epochs, and how many were read from a fresh pipeline
                self.source.observe([r[:3] for r in read])
                epoch, reread = self.source.epoch_of(first + int(i)), hits
            steps.append(
                StepResult(
                    loss=float(losses[i]),
                    aggregated=len(picked),
                    stale_dropped=int(late[i]),
                    workers=sorted(found - {-1}),
                    applied=bad is None,
                    nonfinite=bad,
                    read_ahead=hits if self._readahead else None,
                    epoch=epoch,
                    reread=reread,
                    # Shares of the block per step: the chief's dispatch, then the steps running on workers and ps.
                    timing={"dispatch": (t1 - t0) / count, "steps": (t2 - t1) / count},
                )
            )
        return steps

    def _pushed(self, pending: dict, results: dict, interrupted: Callable[[], bool]) -> bool:
        """A one-step block's closures wait for nothing: let N of them push before the apply starts, so
        that no apply waits on the ps while a worker still makes its functions and data (the first
        dispatch after `prepare`: a blocking apply there was seen to hold it up). False if interrupted."""
        waiting = set(pending)
        while waiting and len(results) < self.train.replicas_to_aggregate:
            done, waiting = futures.wait(waiting, timeout=0.25, return_when=futures.FIRST_COMPLETED)
            for future in done:
                results[pending[future]] = future.result()
                self._finished.append(pending[future])
            if len(results) < self.train.replicas_to_aggregate and interrupted():
                self._late.update(waiting)
                return False
        return True

    def _apply_block(self, first: tf.Tensor, count: tf.Tensor):
        """The block's apply loop: on the ps when there is one (no call between its steps leaves the ps);
        with several ps on the chief, as a ps cannot reach another ps (ParameterServerStrategy's filters)."""
        if self._apply_device is None:
            return self._apply_fn(first, count)
        with tf.device(self._apply_device):
            return self._apply_fn(first, count)

    def _wait(self, applying, pending: dict, results: dict, interrupted: Callable[[], bool], can_stall=False) -> bool:
        """Wait for `applying` (or, when None, for every closure in `pending`), surfacing closure errors at
        once. When `interrupted()` turns true, or (`can_stall`: a block of several steps, whose closures
        wait for each other at the gate) the global step stalls, stop the apply at the next step
        boundary; returns whether it stalled."""
        waiting = {f for f, slot in pending.items() if slot not in results} | ({applying} if applying else set())
        unblocked_at, stalled = None, False
        progress = (int(self.state.global_step.numpy()), time.monotonic())
        while (applying is not None and not applying.done()) or (applying is None and waiting):
            done, waiting = futures.wait(waiting, timeout=0.25, return_when=futures.FIRST_COMPLETED)
            for future in done:
                if future is applying:
                    continue
                results[pending[future]] = future.result()  # a job error in a closure surfaces here
                self._finished.append(pending[future])
            if applying is None or applying.done():
                continue
            if can_stall and not stalled and not interrupted() and time.monotonic() - progress[1] > 1.0:
                progress, stalled = self._stalled(progress)
            if stalled or interrupted():
                now = time.monotonic()
                if unblocked_at is None or now - unblocked_at > 0.5:
                    self._interrupt()
                    unblocked_at = now
        return stalled

    def _stalled(self, progress: tuple[int, float]) -> tuple[tuple[int, float], bool]:
        """(the new (global step, when it last moved), whether it has not moved for too long). A block
        stalls when a worker fails or hangs: ClusterCoordinator re-runs the worker's closure only after
        the closures in flight end, and those wait at the gate for the failed slot."""
        step = int(self.state.global_step.numpy())
        if step != progress[0]:
            return (step, time.monotonic()), False
        silent = time.monotonic() - progress[1]
        if silent <= max(STALL_MIN_S, STALL_STEPS * self._step_s):
            return progress, False
        log.warning("step %d: no progress for %.0fs (a worker failed or hangs); ending the block there", step, silent)
        return progress, True

    def _interrupt(self) -> None:
        """Stop the running apply before its next update: set the flag it checks, and give every slot
        of the step it may be waiting for an empty gradient so its takes return (the step is then not
        applied; the accumulators are not reused: a restarted chief makes fresh ones)."""
        self._stopping.assign(True)
        self._unblock_fn(self.state.global_step.read_value())

    def close(self) -> int:
        """Wait briefly for surplus closures (a job error in one still surfaces); returns how many late
        gradients arrived after the last step's apply, dropped."""
        if self._late:
            futures.wait(self._late, timeout=30.0)
        for future in [f for f in self._late if f.done()]:
            future.result()
        prepared = hasattr(self, "aggregator")
        late = int(tf.function(self.aggregator.pending_arrivals, autograph=False)().numpy()) if prepared else 0
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        return late
