"""The training loop shared by cluster and standalone runs: resume, steps, checkpoints, export.

run = TrainingRun.start(...)                   # job, engine, control-plane agent, restore, banner
step = run.first_step
while step < train.steps:
    count = block_length(step, train, first)   # up to steps_per_execution and ~2 s, never past a checkpoint or eval
    results = engine.run(step, count)          # synchronous updates, N gradients each, one dispatch
    run.record(step, results)                  # metrics.jsonl (a line per step), progress, heartbeat report
    step += len(results)
    run.maybe_checkpoint(step)                 # every checkpoint_every steps
    run.maybe_evaluate(step)                   # every eval_every steps
    if stop requested: checkpoint and exit 128+N
run.finish()                                   # final checkpoint, evaluation, SavedModel, done line
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tensorflow as tf

from chief.callbacks import fit_callbacks
from chief.data.eval_set import EvalSet, eval_set
from chief.data.train_source import explain_worker_error, train_source
from chief.epochs import EpochPlan, epoch_plan, pass_length
from chief.export import export_saved_model
from chief.job import Job, job_file, load_job
from chief.metrics import MetricsLog, Progress, learning_rate_fn
from chief.scores import evaluate
from chief.state.adapted import check_adapted
from chief.state.checkpoints import Checkpoints, remove_partial_saves
from chief.state.model_state import variables_of
from chief.state.route import open_checkpoints, serving_model
from chief.state.sharding import placement_summary
from chief.step.dispatch import ClusterEngine, connect
from chief.step.engine import Engine, StepResult
from chief.step.local import LocalEngine
from cluster.config import TrainConfig
from cluster.control.agent import Agent, Report, agent_from_env
from cluster.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    PstrainError,
    RestartableError,
    TrainingError,
    UserCodeError,
    WriteError,
    report,
    user_error,
    write_error,
    writing,
)
from cluster.preflight import check_writable
from cluster.run_times import done_fields, done_phrase, run_times
from cluster.rundir import RunDir, latest_checkpoint_step, note_start, read_records
from cluster.stop import StopTrap
from cluster.stop_report import stop_outcome
from cluster.taskenv import TaskEnv, wait_until_ready
from cluster.tfconfig import chief_address, tf_config_text

log = logging.getLogger("pstrain.chief")


class StartupClock:
    """Where a chief's start-up goes: seconds per phase, from the process's start."""

    def __init__(self):
        import psutil

        self.last = psutil.Process().create_time()
        self.phases: dict[str, float] = {}
        self.mark("process start and imports")

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases[phase] = now - self.last
        self.last = now

    def summary(self) -> str:
        return ", ".join(f"{phase} {seconds:.2f}s" for phase, seconds in self.phases.items())


class StoppedDuringStartup(Exception):
    """A stop arrived before the first step: the chief ends without a checkpoint (nothing was trained)."""


def stop_point(stop: StopTrap) -> None:
    """Between the phases of start-up: end it at once when a stop was requested."""
    if stop.requested:
        raise StoppedDuringStartup


BLOCK_SECONDS = 2.0  # a block of slow steps is cut to about this long, so progress and metrics keep coming


def block_length(step: int, train: TrainConfig, first_step: int, step_seconds: float | None = None) -> int:
    """How many steps to run from `step` in one dispatch: `steps_per_execution`, cut short so that a
    block ends at every checkpoint and evaluation step and at the last step, and (given the last
    block's `step_seconds`) lasts about `BLOCK_SECONDS` at most. A run's first block is one step: it
    traces and warms up every function, and the first step's line comes at once."""
    most = train.steps_per_execution
    if step_seconds:
        most = min(most, max(1, int(BLOCK_SECONDS / step_seconds)))
    end = min(step + (1 if step == first_step else most), train.steps)
    for every in (train.checkpoint_every, train.eval_every):
        if every:
            end = min(end, (step // every + 1) * every)
    return end - step


def start_agent(stop: StopTrap) -> Agent | None:
    """Register the chief with the control plane (when the launcher runs one) and heartbeat."""
    agent = agent_from_env("chief", 0, chief_address(tf_config_text()))
    if agent is None:
        return None
    agent.register(devices=[], deadline_s=30)

    def on_stop(reason: str, _lost: bool) -> None:
        log.info("stopping: %s", reason)
        stop.request()

    agent.start(on_stop)
    return agent


@dataclass
class TrainingRun:
    """Everything one run of the loop needs, and the bookkeeping between steps."""

    run_dir: RunDir
    train: TrainConfig
    job: Job
    engine: Engine
    checkpoints: Checkpoints
    metrics: MetricsLog
    progress: Progress
    agent: Agent | None
    eval_set: EvalSet  # read in batches from this machine's copy (chief/data/eval_set.py)
    sample: object  # the first training example's features: how the mirror is built, the export's signature
    first_step: int
    startup: StartupClock
    starts: list[dict]  # RUN_DIR/starts.jsonl as this chief started
    stale_total: int = 0
    saved: int = -1  # the step of the checkpoint this run wrote last
    gradients_by_worker: dict[int, int] = field(default_factory=dict)
    epochs: EpochPlan | None = None  # training by epochs (chief/epochs.py): train.steps is theirs

    @classmethod
    def start(cls, run_dir: RunDir, train: TrainConfig, standalone: bool, stop: StopTrap) -> TrainingRun:
        """Load the job, build the engine (the seed's initial weights), restore the latest checkpoint."""
        startup = StartupClock()
        check_writable(run_dir.path)  # before anything, the restore included: a run that could not save is refused now
        with writing(run_dir.path):
            note_start(run_dir.path, "chief")  # `done in` counts restarts (cluster/run_times.py)
        starts = read_records(run_dir.starts)  # read now: the run's times, whatever befalls the run dir
        stop_point(stop)
        if not wait_until_ready(train.startup_timeout + 30, stopped=lambda: stop.requested):
            stop_point(stop)
            raise PstrainError(f"the launcher did not report the cluster ready within {train.startup_timeout:g}s")
        joined = None if standalone else connect()  # before the job's module is imported (see connect)
        startup.mark("wait for the servers and join them")
        job = load_job(train.job)
        source = train_source(job, run_dir, train)  # built again on each worker from its own files
        if epochs := epoch_plan(train, *pass_length(source)):
            train = epochs.resolve(train)  # in steps from here on, on both engines alike
        evaluation = eval_set(job, source.first)
        sample = tf.nest.map_structure(np.asarray, source.first(1)[0])
        startup.mark("job and data")
        stop_point(stop)
        engine = ClusterEngine(job, train, source, sample, joined=joined) if joined else LocalEngine(job, train, source, sample)
        startup.mark("build and check the job")
        stop_point(stop)
        agent = None if standalone else start_agent(stop)
        if not standalone:
            log.info("placement: %s", placement_summary(variables_of(engine.state.model.weights)))
        checkpoints = open_checkpoints(engine.state, job, sample, run_dir.checkpoints, local=standalone)
        # Before a restore writes the checkpoint's statistics into the model: what model_fn adapted now.
        check_adapted(engine.state.model, run_dir.adapted, resumed=checkpoints.latest is not None)
        stop_point(stop)
        first = checkpoints.restore_latest()
        if first:
            log.info("resumed from %s at step %d", checkpoints.latest, first)
        engine.prepare(first)
        startup.mark("restore and prepare")
        progress = Progress(train.steps, first, tty=TaskEnv.from_env().tty, epochs=epochs)
        run = cls(
            run_dir,
            train,
            job,
            engine,
            checkpoints,
            MetricsLog(
                run_dir.metrics,
                first,
                examples_per_step=train.global_batch_size,
                learning_rate=learning_rate_fn(engine.state.optimizer),
            ),
            progress,
            agent,
            evaluation,
            sample,
            first,
            startup,
            starts,
            epochs=epochs,
        )
        progress.message(run.banner(standalone))
        return run

    def banner(self, standalone: bool) -> str:
        t = self.train
        backups = t.total_num_replicas - t.replicas_to_aggregate
        return (
            f"pstrain: {'standalone' if standalone else 'cluster'} run of {self.job.spec}, steps {self.first_step}..{t.steps}, "
            f"global batch {t.global_batch_size} = {t.replicas_to_aggregate} x {t.slot_batch_size}"
            + (f", {backups} backup" if backups else "")
            + (f", {self.epochs.epochs} epochs of {self.epochs.steps_per_epoch} steps" if self.epochs else "")
        )

    def record(self, first: int, results: list[StepResult], seconds: float) -> None:
        """Log a block's steps (`seconds` is the block's time, shared evenly); a withheld (non-finite) step
        under on_nonfinite "stop" is checkpointed before it and ends the run."""
        per_step = seconds / max(len(results), 1)
        for step, result in enumerate(results, first):
            self.stale_total += result.stale_dropped
            if not result.applied and self.train.on_nonfinite == "stop":
                self.checkpoints.save(step)  # the state before the bad step; its update was withheld
                self.metrics.flush()
                what = (
                    f"loss is {result.loss}"
                    if result.nonfinite == "loss"
                    else f"the mean gradient of {result.nonfinite} is not finite (loss {result.loss})"
                )
                raise TrainingError(
                    f"step {step}: {what}; stopped without applying it, checkpoint at step {step} "
                    '(lower the learning rate, check the data, or set train.on_nonfinite = "skip")'
                )
            self.metrics.write(
                {
                    "step": step,
                    "loss": result.loss,
                    "aggregated": result.aggregated,
                    "stale_dropped": result.stale_dropped,
                    "workers": result.workers,
                    "seconds": round(per_step, 6),
                    "time": round(time.time(), 3),  # wall clock at the end of the step's block
                    **({"skipped": result.nonfinite} if not result.applied else {}),
                    **({"timing": {k: round(v, 6) for k, v in result.timing.items()}} if result.timing else {}),
                    **({"read_ahead": result.read_ahead} if result.read_ahead is not None else {}),
                    **({"epoch": self.epochs.epoch_of(step)} if self.epochs else {}),
                    **({"epoch": result.epoch} if result.epoch is not None and not self.epochs else {}),
                    **({"reread": result.reread} if result.reread is not None else {}),
                }
            )
            examples_per_s = self.train.global_batch_size / max(per_step, 1e-9)
            self.progress.update(step, result.loss, examples_per_s, result.aggregated, per_step)
            for worker in result.workers:
                self.gradients_by_worker[worker] = self.gradients_by_worker.get(worker, 0) + 1
        if self.agent and results:
            self.agent.report = Report("training", first + len(results), dict(self.gradients_by_worker))
        if first == self.first_step:  # the run's first block is its first step
            self.startup.mark("first step")
            log.info("start-up: %s", self.startup.summary())

    def maybe_checkpoint(self, done: int) -> None:
        every = self.train.checkpoint_every
        if every and done % every == 0 and done < self.train.steps:
            self.checkpoints.save(done)
            self.saved = done
            self.metrics.flush()  # TensorBoard events on disk with each checkpoint

    def maybe_evaluate(self, done: int) -> dict[str, float] | None:
        """Every `eval_every` steps: evaluate the model after `done` steps (the training state itself, read
        from the ps; the chief's mirror where it keeps one), training waiting as long as this takes, and
        write an eval line."""
        every = self.train.eval_every
        if not every or done % every:
            return None
        self.checkpoints.sync()
        scores = evaluate(self.job, self.checkpoints.model(), self.eval_set)
        self.metrics.write({"event": "eval", "step": done, **scores})
        log.info("eval at step %d: %s", done, ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
        return scores

    def stop_with_checkpoint(self, done: int, stop: StopTrap, standalone: bool) -> int:
        """Save the state after `done` applied steps (none to save when no step ran, nor when checkpoint
        `done` was just written: a stop during that write); say so and exit as the stop signal asks (in a
        cluster the launcher says it on the console: the chief logs it)."""
        trained = done > self.first_step
        if trained and done == self.saved:
            log.info("checkpoint %d is already written: the stop does not write it again", done)
        elif trained:
            self.checkpoints.save(done)
        self.metrics.close()
        checkpoint = done if trained else latest_checkpoint_step(self.run_dir.path)
        say_stopped(stop, checkpoint, "saved" if trained else "start-up", standalone, self.progress.message)
        return stop.exit_code

    def finish(self, steps: int) -> int:
        """Final checkpoint after `steps` (train.steps, fewer where a callback stopped the run), evaluation
        of the trained weights, SavedModel export, the done line."""
        self.stale_total += self.engine.close()
        if self.first_step < steps:
            self.checkpoints.save(steps)
        final = self.checkpoints.model()  # the weights just saved (or restored): the state itself, or the mirror
        scores = evaluate(self.job, final, self.eval_set)
        exported = serving_model(self.checkpoints, self.job, self.sample)
        if exported is not None:
            export_saved_model(exported, self.sample, self.run_dir.saved_model)
        else:
            self.progress.message(
                f"pstrain: warning: no SavedModel: the model is split over ps and larger than the chief's memory; serve it "
                f"from {self.checkpoints.latest} (tf.train.Checkpoint(model=model_fn()).restore on a machine that holds it)"
            )
        times = run_times(self.starts, time.time())
        done = {"event": "done", "steps": steps, **scores, "stale_dropped_total": self.stale_total}
        self.metrics.write({**done, **done_fields(times), "peak_rss_mib": peak_rss_mib()})
        self.metrics.close()
        summary = ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
        self.progress.message(f"pstrain: {done_phrase(times)}; {summary}; saved model in {self.run_dir.saved_model}")
        return EXIT_OK


def peak_rss_mib() -> int:
    """This process's peak resident memory so far, in MiB (the kernel's high-water mark)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB on Linux


def say_stopped(stop: StopTrap, checkpoint: int | None, how: str, standalone: bool, message=print) -> None:
    """The stop's one line: on the console standalone; in the chief's log in a cluster, whose launcher
    says it on the console (it alone knows what stopped the run)."""
    line = stop_outcome(stop.cause, stop.commanded, stop.exit_code, checkpoint, how).line
    if standalone:
        message(line)
    else:
        log.info("%s", line.removeprefix("pstrain: "))


def run(run_dir: RunDir, train: TrainConfig, standalone: bool, stop: StopTrap) -> int:
    """Train to `train.steps` (resuming from the latest checkpoint); returns the exit code. A stop
    (`stop`, entered by the caller as early as it can) ends start-up between its phases, and training
    at the next step boundary with a checkpoint."""
    try:
        run = TrainingRun.start(run_dir, train, standalone, stop)
    except StoppedDuringStartup:
        say_stopped(stop, latest_checkpoint_step(run_dir.path), "start-up", standalone)
        return stop.exit_code
    train, callbacks = run.train, fit_callbacks(run)  # train: with train.epochs, in steps
    callbacks.begin(run.first_step)
    step, step_seconds = run.first_step, None
    while step < train.steps:
        if stop.requested:  # before each block: a stop never waits for one to run
            log.info("stop noticed at step %d, between blocks", step)
            return run.stop_with_checkpoint(step, stop, standalone)
        t0 = time.monotonic()
        count = callbacks.cut(step, block_length(step, train, run.first_step, step_seconds))
        if step == run.first_step:
            log.info("first block starting at step %d (%d steps)", step, count)
        results = run.engine.run(step, count, interrupted=lambda: stop.requested)
        seconds = time.monotonic() - t0
        run.record(step, results, seconds)
        # The run's first step traces every function: the blocks are sized from warm ones.
        step_seconds = seconds / max(len(results), 1) if step > run.first_step else None
        step += len(results)
        run.maybe_checkpoint(step)
        if callbacks.after_block(step - len(results), [r.loss for r in results], run.maybe_evaluate(step)):
            run.progress.message(f"pstrain: a callback set stop_training: the run ends after step {step} of {train.steps}")
            break
    if stop.requested:
        return run.stop_with_checkpoint(step, stop, standalone)
    callbacks.end(step)
    return run.finish(step)


def last_line(message: str) -> str:
    """TF wraps errors from traced code as "in user code: ... <the error>": keep the error."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def record_traceback(run_dir: RunDir, error: BaseException, standalone: bool) -> Path:
    """Put `error`'s full traceback in the task's log (standalone: a file of that name); returns its path."""
    path = run_dir.log("chief-0")
    text = "".join(traceback.format_exception(error))
    try:
        if standalone:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(text)
        else:  # the launcher copies this process's output to that log, and only pstrain's lines to the console
            print(text, file=sys.stderr, flush=True)
    except OSError:
        pass
    return path


def remove_half_written(run_dir: RunDir) -> None:
    """After a failed write: delete what a save cut short left (frees its space); the last complete
    checkpoint stays. Where the directory cannot be changed either, nothing is there to delete."""
    try:
        remove_partial_saves(run_dir.checkpoints)
    except OSError:
        pass


def main_guarded(run_dir: RunDir, train: TrainConfig, standalone: bool, stop: StopTrap | None = None) -> int:
    """Run, turning user mistakes and training errors into one-line messages and exit codes. `stop`: the
    caller's stop trap, entered before the imports (else one is entered here)."""
    if stop is None:
        with StopTrap() as stop:
            return main_guarded(run_dir, train, standalone, stop)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    log.setLevel(logging.INFO)
    tf.get_logger().setLevel(logging.WARNING)
    try:
        try:
            return run(run_dir, train, standalone, stop)
        except tf.errors.UnavailableError as e:
            first = e.message.splitlines()[0] if e.message else "unavailable"
            raise RestartableError(
                f"a cluster task became unreachable ({first}); run the same command again to resume from the last checkpoint"
            ) from None
    except UserCodeError as e:  # raised by the engine, which knows the step
        trace = record_traceback(run_dir, e.__cause__ or e, standalone)
        return report(f"{e}; traceback in {trace}", e.exit_code)
    except RestartableError as e:  # the launcher restarts the chief, or says to run again: it speaks, not us
        log.warning("%s", e)
        return e.exit_code
    except PstrainError as e:
        if isinstance(e, WriteError):
            remove_half_written(run_dir)
        return report(e)
    except Exception as e:  # a job that raises: one line here, the traceback in the log
        if (failed := write_error(e, run_dir.path, gone=not run_dir.path.exists())) is not None:  # a write not in `writing`
            remove_half_written(run_dir)
            return report(failed)
        if isinstance(e, tf.errors.OpError) and (data_error := explain_worker_error(e, [])):
            return report(data_error)  # e.g. a data file missing here
        trace = record_traceback(run_dir, e, standalone)
        if found := user_error(e, job_file(train.job)):
            return report(f"{found}; traceback in {trace}", found.exit_code)
        return report(f"{type(e).__name__}: {last_line(str(e))} (traceback in {trace})", EXIT_FAILURE)
