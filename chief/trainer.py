"""The training loop shared by cluster and standalone runs: resume, steps, checkpoints, export.

run = TrainingRun.start(...)           # job, engine, control-plane agent, restore, banner
for step in range(run.first_step, train.steps):
    result = engine.step(step)         # one synchronous update (N gradients applied)
    run.record(step, result)           # metrics.jsonl, progress, heartbeat report
    run.maybe_checkpoint(step + 1)     # every checkpoint_every steps
    run.maybe_evaluate(step + 1)       # every eval_every steps
    if stop requested: checkpoint and exit 128+N
run.finish()                           # final checkpoint, evaluation, SavedModel, done line
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tensorflow as tf

from chief.checkpoints import Checkpoints
from chief.engines import ClusterEngine, Engine, LocalEngine, StepInterrupted, StepResult
from chief.eval_set import EvalSet, eval_set
from chief.export import evaluate, export_saved_model
from chief.jobs import Job, load_job
from chief.metrics import MetricsLog, Progress, learning_rate_fn
from chief.sharding import placement_summary
from chief.sources import explain_worker_error, train_source
from cluster.config import TrainConfig
from cluster.control.agent import Agent, Report, agent_from_env
from cluster.errors import EXIT_FAILURE, EXIT_OK, PstrainError, RestartableError, TrainingError
from cluster.stop import StopTrap

log = logging.getLogger("pstrain.chief")


def start_agent(stop: StopTrap) -> Agent | None:
    """Register the chief with the control plane (when the launcher runs one) and heartbeat."""
    cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
    agent = agent_from_env("chief", 0, cluster.get("chief", [""])[0])
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

    run_dir: Path
    train: TrainConfig
    job: Job
    engine: Engine
    checkpoints: Checkpoints
    metrics: MetricsLog
    progress: Progress
    agent: Agent | None
    eval_set: EvalSet  # read in batches from this machine's copy (chief/eval_set.py)
    sample: object  # the first training example's features: how the mirror is built, the export's signature
    first_step: int
    started: float = field(default_factory=time.monotonic)
    stale_total: int = 0
    gradients_by_worker: dict[int, int] = field(default_factory=dict)

    @classmethod
    def start(cls, run_dir: Path, train: TrainConfig, standalone: bool, stop: StopTrap) -> TrainingRun:
        """Load the job, build the engine (the seed's initial weights), restore the latest checkpoint."""
        job = load_job(train.job)
        source = train_source(job, run_dir, train)  # built again on each worker from its own files
        evaluation = eval_set(job, source.first)
        sample = tf.nest.map_structure(np.asarray, source.first(1)[0])
        engine = (LocalEngine if standalone else ClusterEngine)(job, train, source, sample)
        agent = None if standalone else start_agent(stop)
        if not standalone:
            log.info("placement: %s", placement_summary(engine.state.model.weights))
        checkpoints = Checkpoints(engine.state, job, sample, run_dir / "checkpoints", local=standalone)
        first = checkpoints.restore_latest()
        if first:
            log.info("resumed from %s at step %d", checkpoints.latest, first)
        engine.prepare(first)
        progress = Progress(train.steps, first, tty=os.environ.get("PSTRAIN_TTY") == "1")
        run = cls(
            run_dir,
            train,
            job,
            engine,
            checkpoints,
            MetricsLog(
                run_dir / "metrics.jsonl",
                first,
                examples_per_step=train.global_batch_size,
                learning_rate=learning_rate_fn(engine.state.optimizer),
            ),
            progress,
            agent,
            evaluation,
            sample,
            first,
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
        )

    def record(self, step: int, result: StepResult, seconds: float) -> None:
        """Log an applied step; a withheld (non-finite) step is checkpointed before it and ends the run."""
        self.stale_total += result.stale_dropped
        if not result.applied:
            self.checkpoints.save(step)  # the state before the bad step; its update was withheld
            self.metrics.flush()
            raise TrainingError(
                f"step {step}: loss is {result.loss}; stopped without applying it, checkpoint at step {step} "
                "(lower the learning rate or check the data)"
            )
        self.metrics.write(
            {
                "step": step,
                "loss": result.loss,
                "aggregated": result.aggregated,
                "stale_dropped": result.stale_dropped,
                "workers": result.workers,
                "seconds": round(seconds, 6),
                "time": round(time.time(), 3),  # wall clock at the end of the step
                **({"timing": {k: round(v, 6) for k, v in result.timing.items()}} if result.timing else {}),
                **({"read_ahead": result.read_ahead} if result.read_ahead is not None else {}),
                **({"epoch": result.epoch} if result.epoch is not None else {}),
                **({"reread": result.reread} if result.reread is not None else {}),
            }
        )
        self.progress.update(step, result.loss, self.train.global_batch_size / max(seconds, 1e-9), result.aggregated)
        for worker in result.workers:
            self.gradients_by_worker[worker] = self.gradients_by_worker.get(worker, 0) + 1
        if self.agent:
            self.agent.report = Report("training", step + 1, dict(self.gradients_by_worker))

    def maybe_checkpoint(self, done: int) -> None:
        every = self.train.checkpoint_every
        if every and done % every == 0 and done < self.train.steps:
            self.checkpoints.save(done)
            self.metrics.flush()  # TensorBoard events on disk with each checkpoint

    def maybe_evaluate(self, done: int) -> None:
        """Every `eval_every` steps: evaluate the model after `done` steps on the checkpoint mirror, a local
        copy (training waits as long as this takes), and write an eval line."""
        every = self.train.eval_every
        if not every or done % every:
            return
        self.checkpoints.sync()
        scores = evaluate(self.job, self.checkpoints.model(), self.eval_set)
        self.metrics.write({"event": "eval", "step": done, **scores})
        log.info("eval at step %d: %s", done, ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))

    def stop_with_checkpoint(self, done: int, stop: StopTrap) -> int:
        """Save the state after `done` applied steps; exit as the stop signal asks."""
        self.checkpoints.save(done)
        self.progress.message(
            f"pstrain: stopped by {stop.name} after step {done}; checkpoint saved, run the same command to resume"
        )
        self.metrics.close()
        return stop.exit_code

    def finish(self) -> int:
        """Final checkpoint, evaluation of the trained weights, SavedModel export, the done line."""
        self.stale_total += self.engine.close()
        wall = time.monotonic() - self.started
        if self.first_step < self.train.steps:
            self.checkpoints.save(self.train.steps)
        final = self.checkpoints.model()  # the weights just saved (or restored), in the mirror
        scores = evaluate(self.job, final, self.eval_set)
        export_saved_model(final, self.sample, self.run_dir / "saved_model")
        done = {"event": "done", "steps": self.train.steps, **scores, "stale_dropped_total": self.stale_total}
        self.metrics.write({**done, "wall_seconds": round(wall, 3), "peak_rss_mib": peak_rss_mib()})
        self.metrics.close()
        summary = ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
        self.progress.message(f"pstrain: done in {wall:.1f}s; {summary}; saved model in {self.run_dir / 'saved_model'}")
        return EXIT_OK


def peak_rss_mib() -> int:
    """This process's peak resident memory so far, in MiB (the kernel's high-water mark)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB on Linux


def run(run_dir: Path, train: TrainConfig, standalone: bool) -> int:
    """Train to `train.steps` (resuming from the latest checkpoint); returns the exit code."""
    with StopTrap() as stop:
        run = TrainingRun.start(run_dir, train, standalone, stop)
        for step in range(run.first_step, train.steps):
            t0 = time.monotonic()
            try:
                result = run.engine.step(step, interrupted=lambda: stop.requested)
            except StepInterrupted:
                return run.stop_with_checkpoint(step, stop)
            run.record(step, result, time.monotonic() - t0)
            run.maybe_checkpoint(step + 1)
            run.maybe_evaluate(step + 1)
            if stop.requested:
                return run.stop_with_checkpoint(step + 1, stop)
        return run.finish()


def last_line(message: str) -> str:
    """TF wraps errors from traced code as "in user code: ... <the error>": keep the error."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def main_guarded(run_dir: Path, train: TrainConfig, standalone: bool) -> int:
    """Run, turning user mistakes and training errors into one-line messages and exit codes."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    log.setLevel(logging.INFO)
    tf.get_logger().setLevel(logging.WARNING)
    try:
        try:
            return run(run_dir, train, standalone)
        except tf.errors.UnavailableError as e:
            first = e.message.splitlines()[0] if e.message else "unavailable"
            raise RestartableError(
                f"a cluster task became unreachable ({first}); run the same command again to resume from the last checkpoint"
            ) from None
    except PstrainError as e:
        print(f"pstrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # a job that raises: one line here, the traceback in the log dir
        if isinstance(e, tf.errors.OpError) and (data_error := explain_worker_error(e, [])):
            print(f"pstrain: error: {data_error}", file=sys.stderr)  # e.g. a data file missing here
            return data_error.exit_code
        trace = run_dir / "logs" / "chief-0.traceback"
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text(traceback.format_exc())
        print(f"pstrain: error: {type(e).__name__}: {last_line(str(e))} (traceback in {trace})", file=sys.stderr)
        return EXIT_FAILURE
