"""ClusterEngine: the cluster's Engine (chief/step/engine.py), the chief's dispatch of blocks of steps.

It builds the strategy and the state on the ps, then per block: schedules each slot's closure (the
worker loop, worker/replica/loop.py) with its positions, calls the apply loop once, waits for both
while surfacing a closure's error at once, ends a block whose global step stalls (a worker failed or
hangs) or that is interrupted at the next step boundary, and explains a cancelled closure (a ps that
died). What the packed results mean and when a block stalls are decided by pure functions
(chief/step/block_results.py). This path is timing-sensitive (the fault tests are its proof).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent import futures

import numpy as np
import tensorflow as tf

from chief.contract.framework import trainable_of, variables_of
from chief.contract.job import Job, job_file
from chief.data.train_source import explain_worker_error
from chief.state.initial_values import PS_INIT_MIN_BYTES
from chief.state.model_state import allow_loss_scaling_under_ps, build_state
from chief.state.sharding import partitioner
from chief.step.block_results import (
    STALL_MIN_S,
    STALL_STEPS,
    apply_widths,
    block_results,
    lean_applied,
    stall_decision,
    unpack_applied,
)
from chief.step.engine import StepResult, inspected_replica, slot_positions, value_names
from chief.step.hybrid import DenseCopies, Watchdog, collectives_lost, lean, refuse
from chief.step.rounding import same_rounding_everywhere
from chief.step.strategy import PeeredPSStrategy
from cluster.config import TrainConfig
from cluster.errors import RestartableError, user_error
from cluster.tfconfig import training_resolver
from worker.input.lookups import local_lookups
from worker.input.readahead import ReadAhead, schedule_order
from worker.input.sources import Source
from worker.ps.aggregator import SyncReplicasAggregator
from worker.ps.apply import apply_loop
from worker.ps.gate import StepGate
from worker.replica.loop import LEAN_COLUMNS, lean_loop, worker_loop

log = logging.getLogger("pstrain.chief")
# How often a waiting chief looks at `interrupted()`: well inside one step of a small model, so a stop
# ends the block at the next step boundary rather than after a whole fast block.
INTERRUPT_POLL_S = 0.02


def connect(resolver=None) -> tuple:
    """Join the cluster (`resolver`, default TF_CONFIG's training tasks): this process's devices become
    /job:chief/... Before the job is imported: a lookup table or variable the job's module makes at
    import lives on a device of the context it was made in, and /job:localhost is gone once joined
    ("/job:localhost/replica:0/task:0/device:CPU:0 unknown device" when a worker's pipeline uses it)."""
    resolver = resolver or training_resolver()
    num_ps = resolver.cluster_spec().num_tasks("ps")
    return PeeredPSStrategy(resolver, variable_partitioner=partitioner(num_ps)), resolver


class ClusterEngine:
    """ParameterServerStrategy + ClusterCoordinator, made synchronous by the aggregator.

    A block of K steps costs the chief one dispatch: each slot's closure runs the K steps in one
    in-graph loop on its worker, waiting at the step gate on the ps between steps (worker/ps/gate.py),
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
        joined: tuple | None = None,
        read_ahead: bool = True,
    ):
        """`source`: the training examples, built again on each worker (worker/input/sources.py); `sample`: one
        example's features; `resolver` names the cluster (default: TF_CONFIG's training tasks);
        variables of at least `ps_init_min_bytes` get their initial values on their ps (chief/state/initial_values.py);
        `joined`: (strategy, resolver) of the cluster `connect` joined (default: joined here); `read_ahead`:
        workers may read a file source's next batch ahead (Switches.read_ahead, PSTRAIN_READ_AHEAD)."""
        self.read_ahead = read_ahead
        self.train = train
        self.source = source
        same_rounding_everywhere()  # as in the standalone reference
        allow_loss_scaling_under_ps()
        self.strategy, resolver = joined or connect(resolver)
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
        self.dense: DenseCopies | None = None  # train.dense = "allreduce": the workers' copies (chief/step/hybrid.py)
        if train.dense == "allreduce":
            refuse(job, train, self.replica, len(self.workers))
            self._watchdog = Watchdog()
            self.names = [name for name, rows in zip(self.names, [True, *self.sparse], strict=False) if rows]
        self._fetchers = futures.ThreadPoolExecutor(max_workers=2 * train.total_num_replicas + 4)
        self._late: set[futures.Future] = set()
        self._finished: list[int] = []  # the last block's slots in the order their closures finished
        self._step_s = 1.0  # the fastest step seen (seconds): how long a block may go without progress
        self.aggregator: SyncReplicasAggregator | None = None  # `prepare` makes it, unless the engine is lean

    def prepare(self, start_step: int) -> None:
        """The per-worker data and the traced functions for a run starting at `start_step`, and (unless the
        engine is lean) the accumulators and the step gate on the ps."""
        variables = trainable_of(self.state.model)
        if any(self.sparse):
            tables = {v.name.split("/part_")[0].split(":")[0] for v, rows in zip(variables, self.sparse, strict=True) if rows}
            log.info("row-sparse gradients (only touched rows move): %s", ", ".join(sorted(tables)))
        device = self.state.global_step.device
        if self.train.dense == "allreduce" and self.dense is None:  # the copies start from the ps's values
            self.dense = DenseCopies(self.strategy, self.job, self.state, self.replica, "/job:worker/replica:0/task:0")
        t = self.train
        if t.total_num_replicas > len(self.workers) and t.steps_per_execution > 1:
            log.info(
                "%d replica slots on %d workers: one step per dispatch (a block's closures must all run at once)",
                t.total_num_replicas,
                len(self.workers),
            )
        # Each worker builds its own source (worker/input/sources.py); closures read their slot's examples from it.
        if self.source.streams:
            self.source.begin(start_step)
        self._expected = self.source.fingerprint()
        reads_ahead = self.source.reads_ahead and self.read_ahead
        self._readahead = ReadAhead(t.slot_batch_size, t.total_num_replicas) if reads_ahead else None
        dataset_fn = local_lookups(self.strategy, functools.partial(self.source.dataset_fn, self._readahead))
        self._iterator = iter(self.coordinator.create_per_worker_dataset(dataset_fn))
        with tf.device(device):
            self._stopping = tf.Variable(False, trainable=False, name="pstrain_stopping")
        self.lean = self.dense is not None and lean(self.dense)
        if self.lean:  # no ps on a step's path (worker/replica/loop.py lean_loop): no aggregator, gate or apply loop
            log.info('train.dense = "allreduce" and no row-sparse table: the workers take each step with no ps on its path')
            self._lean_fn = lean_loop(
                self.strategy, self.replica, self.source, self._expected, self._readahead, self.dense, self._stopping
            )
        else:
            self._prepare_ps_path(variables, device, start_step)
        self._warm = False

    def _prepare_ps_path(self, variables: list, device: str, start_step: int) -> None:
        """The aggregator, the step gate (opened at `start_step`), the closures' loop and the apply loop:
        every step's path through the ps (train.dense = "ps", or "allreduce" with row-sparse tables)."""
        t = self.train
        kept = [i for i, rows in enumerate(self.sparse) if rows or self.dense is None]  # pushed to the ps
        self.aggregator = SyncReplicasAggregator(
            [self.loss, *(variables[i] for i in kept), *self.replica.state_variables],
            required=t.replicas_to_aggregate,
            total_slots=t.total_num_replicas,
            start_step=start_step,
            sparse=[False, *(self.sparse[i] for i in kept), *[False] * len(self.replica.state_variables)],
            arrivals_device=device,
        )
        self.gate = StepGate(device)
        tf.function(self.gate.open, autograph=False)(tf.constant(start_step, tf.int64))
        backups = t.total_num_replicas > t.replicas_to_aggregate
        self._worker_fn = worker_loop(
            self.strategy,
            self.state,
            self.replica,
            self.aggregator,
            self.gate,
            self.source,
            self._expected,
            self._readahead,
            backups,
            self.dense,
        )
        self._apply_widths = apply_widths(t.total_num_replicas, len(self.names))
        self._apply_fn = apply_loop(
            self.state,
            self.replica,
            self.aggregator,
            self.gate,
            self.loss,
            self._stopping,
            self._apply_widths,
            t.on_nonfinite == "skip",
            None if self.dense is None else self.dense.tables,
        )
        self._unblock_fn = tf.function(self.aggregator.unblock, autograph=False)

    def run(self, first: int, count: int, interrupted: Callable[[], bool] = lambda: False) -> list[StepResult]:
        """Run steps first..first+count-1, in one dispatch when the engine is warm; see `Engine.run`. With
        more slots than workers a closure would wait at the gate for slots queued behind it on its own
        worker: then one step per dispatch, as the closures of a step can run one after another."""
        results: list[StepResult] = []
        if self.train.dense == "allreduce":
            self._watchdog.tick()
            self._watchdog.armed = True
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
            if self.dense is not None and (why := collectives_lost(e)):
                raise RestartableError(f'train.dense = "allreduce": {why}; every worker restarts, then the chief') from e
            error = self._cancelled_by(e) if isinstance(e, tf.errors.CancelledError) else e
            step = None if self.lean else self._open_step()  # (a lean block's global step is its first)
            found = explain_worker_error(error, self.workers) or user_error(error, job_file(self.job.spec), step)
            if found is None:
                raise error from (None if error is e else e)
            raise found from error
        finally:
            if self.train.dense == "allreduce":
                self._watchdog.armed = False
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
        # dispatch) takes them in stream order and reads both forward (worker/input/streams.py).
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
            remote = self.coordinator.schedule(self._lean_fn if self.lean else self._worker_fn, args=args)
            pending[self._fetchers.submit(remote.fetch)] = slot
        t1 = time.perf_counter()
        self._finished, results = [], {}
        if self.lean:
            return self._lean_block(first, count, pending, results, interrupted, t0, t1)
        # (With train.dense = "allreduce" a closure's step ends only once the apply ran: no waiting for it.)
        if count == 1 and self.dense is None and not self._pushed(pending, results, interrupted):
            return []  # interrupted before the step's gradients were in: nothing applied
        applying = self._fetchers.submit(self._apply_block, first_t, count_t)
        # A lost worker stalls even a one-step block when the workers' collectives carry the step (once warm:
        # a cold first step may take long to trace).
        can_stall = count > 1 or (self.dense is not None and self._warm)
        stalled = self._wait(applying, pending, results, interrupted, can_stall=can_stall)
        applied = unpack_applied(applying.result().numpy(), self._apply_widths)
        proceeded = applied[5]  # (losses, chosen, workers, late, finite, proceeded)
        if stalled and self.dense is not None:
            raise RestartableError(
                f'step {self._open_step()}: a worker failed or hangs under train.dense = "allreduce"; every worker '
                "restarts, then the chief"
            )
        if stalled:  # the accumulators hold the unblocking pushes: start afresh from the global step
            self.prepare(int(self.state.global_step.numpy()))
        t2 = time.perf_counter()
        if not stalled and proceeded.all() and count > 1:
            self._step_s = min(self._step_s, (t2 - t1) / count)
        # Without backups every closure is in every step: wait for them all (they pushed the last step).
        if t.total_num_replicas == t.replicas_to_aggregate and not stalled:
            self._wait(None, {f: slot for f, slot in pending.items() if slot not in results}, results, interrupted)
        self._late.update(f for f in pending if pending[f] not in results)
        if self.dense is not None:  # the ps's copy of the dense variables, for checkpoints and evaluations
            at = tf.constant(int(self.state.global_step.numpy()), tf.int64)
            self.coordinator.schedule(self.dense.write_back, args=(at,)).fetch()
        return self._results(applied, results, first, count, (t0, t1, t2))

    def _lean_block(self, first: int, count: int, pending: dict, results: dict, interrupted, t0: float, t1: float) -> list:
        """A lean block (`lean_loop`): wait for every closure (a stop request is set on the ps for the
        workers to read), then move the ps to the steps they applied: the copies written back, the
        global step, the optimizer's step count (written back with the copies) and the last loss."""
        self._wait(None, pending, results, interrupted, lean_limit_s=self._lean_limit(count))
        applied, closures = lean_applied(results, count, LEAN_COLUMNS, self.train.total_num_replicas)
        done = len(applied[0]) - (0 if applied[4].all() else 1)  # a withheld last step is no update
        if done:
            self.coordinator.schedule(self.dense.write_back, args=(tf.constant(first + done, tf.int64),)).fetch()
            self.loss.assign(float(applied[0][done - 1]))
        self.state.global_step.assign(first + done)
        t2 = time.perf_counter()
        if done == count and count > 1:
            self._step_s = min(self._step_s, (t2 - t1) / count)
        return self._results(applied, closures, first, count, (t0, t1, t2))

    def _results(self, applied: tuple, closures: dict, first: int, count: int, times: tuple) -> list[StepResult]:
        """`block_results` of a block, with each step's share of it: the chief's dispatch (t0 to t1), then
        the steps running on workers and ps (t1 to t2)."""
        t0, t1, t2 = times
        stream = self.source if self.source.streams else None
        timing = {"dispatch": (t1 - t0) / count, "steps": (t2 - t1) / count}
        return block_results(applied, closures, first, self.names, stream, bool(self._readahead), timing)

    def _lean_limit(self, count: int) -> float | None:
        """How long a warm lean block may run before it counts as stalled (a worker failed or hangs: its
        peers wait in the collective, which also fails after COLLECTIVE_TIMEOUT_S): what the gate's path
        allows each step (`stall_decision`), for each of its `count` steps. None while cold (the first
        block traces and builds)."""
        if not self._warm:
            return None
        return count * max(STALL_MIN_S, STALL_STEPS * self._step_s)

    def _pushed(self, pending: dict, results: dict, interrupted: Callable[[], bool]) -> bool:
        """A one-step block's closures wait for nothing: let N of them push before the apply starts, so
        that no apply waits on the ps while a worker still makes its functions and data (the first
        dispatch after `prepare`: a blocking apply there was seen to hold it up). False if interrupted."""
        waiting = set(pending)
        while waiting and len(results) < self.train.replicas_to_aggregate:
            done, waiting = futures.wait(waiting, timeout=INTERRUPT_POLL_S, return_when=futures.FIRST_COMPLETED)
            for future in done:
                results[pending[future]] = future.result()
                self._finished.append(pending[future])
            if len(results) < self.train.replicas_to_aggregate and interrupted():
                self._late.update(waiting)
                return False
        return True

    def _apply_block(self, first: tf.Tensor, count: tf.Tensor):
        """The block's apply loop, on the global step's ps: no call between its steps leaves the ps tasks
        (they see each other, chief/step/strategy.py)."""
        with tf.device(self.state.global_step.device):
            return self._apply_fn(first, count)

    def _wait(
        self, applying, pending: dict, results: dict, interrupted: Callable[[], bool], can_stall=False, lean_limit_s=None
    ) -> bool:
        """Wait for `applying` (or, when None, for every closure in `pending`), surfacing closure errors at
        once. When `interrupted()` turns true, or (`can_stall`: a block of several steps, whose closures
        wait for each other at the gate) the global step stalls, stop the apply at the next step
        boundary; returns whether it stalled. A lean block (`applying` None, `lean_limit_s` given) sets
        the stop request when interrupted, and is stalled (RestartableError) past `lean_limit_s`."""
        waiting = {f for f, slot in pending.items() if slot not in results} | ({applying} if applying else set())
        unblocked_at, stalled, began = None, False, time.monotonic()
        progress = (int(self.state.global_step.numpy()), time.monotonic())
        while (applying is not None and not applying.done()) or (applying is None and waiting):
            if self.train.dense == "allreduce":
                self._watchdog.tick()
            done, waiting = futures.wait(waiting, timeout=INTERRUPT_POLL_S, return_when=futures.FIRST_COMPLETED)
            for future in done:
                if future is applying:
                    continue
                results[pending[future]] = future.result()  # a job error in a closure surfaces here
                self._finished.append(pending[future])
            if self.lean and applying is None and waiting:
                if interrupted() and unblocked_at is None:
                    self._stopping.assign(True)  # every worker reads it, and all end at the same step
                    log.info("stop noticed; the workers end the block together at a step boundary")
                    unblocked_at = time.monotonic()
                if lean_limit_s is not None and time.monotonic() - began > lean_limit_s:
                    raise RestartableError(
                        f'the block from step {self._open_step()}: a worker failed or hangs under train.dense = "allreduce" '
                        f"(it has run {lean_limit_s:.0f}s); every worker restarts, then the chief"
                    )
            if applying is None or applying.done():
                continue
            if can_stall and not stalled and not interrupted() and time.monotonic() - progress[1] > 1.0:
                progress, stalled = self._stalled(progress)
            if stalled or interrupted():
                now = time.monotonic()
                if unblocked_at is None or now - unblocked_at > 0.5:
                    self._interrupt()
                    if unblocked_at is None and not stalled:  # the step the apply had reached when it was told
                        log.info("stop noticed at step %d; ending the block at the next step boundary", self._open_step() or 0)
                    unblocked_at = now
        return stalled

    def _stalled(self, progress: tuple[int, float]) -> tuple[tuple[int, float], bool]:
        """`stall_decision` on the global step read now; warns when the block is to be ended."""
        step = int(self.state.global_step.numpy())
        now = time.monotonic()
        progress, stalled = stall_decision(step, progress, now, self._step_s)
        if stalled:
            log.warning(
                "step %d: no progress for %.0fs (a worker failed or hangs); ending the block there", step, now - progress[1]
            )
        return progress, stalled

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
        prepared = self.aggregator is not None  # (a lean engine has none: nothing arrives late)
        late = int(tf.function(self.aggregator.pending_arrivals, autograph=False)().numpy()) if prepared else 0
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        return late
