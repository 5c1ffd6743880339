"""The training loop shared by cluster and standalone runs: resume, steps, checkpoints, export."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import tensorflow as tf

from chief.checkpoints import Checkpoints
from chief.engines import ClusterEngine, LocalEngine, StepInterrupted
from chief.export import evaluate, export_saved_model, local_model
from chief.jobs import load_job
from chief.metrics import MetricsLog, Progress
from chief.model_state import initial_weights
from chief.sharding import placement_summary
from chief.sources import eval_arrays, explain_worker_error, train_source
from cluster.config import TrainConfig
from cluster.control.agent import Report, agent_from_env
from cluster.errors import EXIT_RESTARTABLE, TrainingError

log = logging.getLogger("pstrain.chief")


class StopRequested:
    """SIGTERM/SIGINT (or the control plane) ask for a checkpoint at the next step, then a clean exit."""

    def __init__(self):
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.signal = signum


def start_agent(stop: StopRequested):
    """Register the chief with the control plane (when the launcher runs one) and heartbeat."""
    cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
    agent = agent_from_env("chief", 0, cluster.get("chief", [""])[0])
    if agent is None:
        return None
    agent.register(devices=[], deadline_s=30)

    def on_stop(reason: str, _lost: bool) -> None:
        log.info("stopping: %s", reason)
        stop.signal = signal.SIGTERM

    agent.start(on_stop)
    return agent


def run(run_dir: Path, train: TrainConfig, standalone: bool) -> int:
    """Train to `train.steps` (resuming from the latest checkpoint); returns the exit code."""
    stop = StopRequested()
    job = load_job(train.job)
    source = train_source(job, run_dir)
    eval_set = eval_arrays(job) or tuple(  # no eval set: the first (up to) 8,192 training examples
        tf.nest.map_structure(np.asarray, source.read_local(np.arange(min(source.num_examples, 8192))))
    )
    sample = tf.nest.map_structure(np.asarray, source.read_local(np.zeros(1, np.int64))[0])
    weights = initial_weights(job, train.seed, sample)

    engine = (LocalEngine if standalone else ClusterEngine)(job, train, source, weights, sample)
    agent = None if standalone else start_agent(stop)
    state = engine.state
    if not standalone:
        log.info("placement: %s", placement_summary(state.model.weights))
    checkpoints = Checkpoints(state, job, weights, sample, run_dir / "checkpoints", local=standalone)
    start = checkpoints.restore_latest()
    if start:
        log.info("resumed from %s at step %d", checkpoints.latest, start)
    engine.prepare(start)
    metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step=start)
    progress = Progress(train.steps, start, tty=os.environ.get("PSTRAIN_TTY") == "1")
    progress.message(
        f"pstrain: {'standalone' if standalone else 'cluster'} run of {job.spec}, steps {start}..{train.steps}, "
        f"global batch {train.global_batch_size} = {train.replicas_to_aggregate} x {train.slot_batch_size}"
        + (
            f", {train.total_num_replicas - train.replicas_to_aggregate} backup"
            if train.total_num_replicas > train.replicas_to_aggregate
            else ""
        )
    )
    t_run = time.monotonic()
    stale_total = 0
    gradients_by_worker: dict[int, int] = {}
    for step in range(start, train.steps):
        t0 = time.monotonic()
        try:
            result = engine.step(step, interrupted=lambda: stop.signal is not None)
        except StepInterrupted:
            return stop_with_checkpoint(checkpoints, step, stop, progress, metrics)
        seconds = time.monotonic() - t0
        stale_total += result.stale_dropped
        if not result.applied:
            checkpoints.save(step)  # the state before the bad step; its update was withheld
            raise TrainingError(
                f"step {step}: loss is {result.loss}; stopped without applying it, checkpoint at step {step} "
                "(lower the learning rate or check the data)"
            )
        metrics.write(
            {
                "step": step,
                "loss": result.loss,
                "aggregated": result.aggregated,
                "stale_dropped": result.stale_dropped,
                "workers": result.workers,
                "seconds": round(seconds, 6),
                "time": round(time.time(), 3),  # wall clock at the end of the step
                **({"timing": {k: round(v, 6) for k, v in result.timing.items()}} if result.timing else {}),
            }
        )
        progress.update(step, result.loss, train.global_batch_size / max(seconds, 1e-9), result.aggregated)
        for worker in result.workers:
            gradients_by_worker[worker] = gradients_by_worker.get(worker, 0) + 1
        if agent:
            agent.report = Report("training", step + 1, dict(gradients_by_worker))
        done = step + 1
        if train.checkpoint_every and done % train.checkpoint_every == 0 and done < train.steps:
            checkpoints.save(done)
        if stop.signal is not None:
            return stop_with_checkpoint(checkpoints, done, stop, progress, metrics)
    stale_total += engine.close()
    wall = time.monotonic() - t_run
    if start < train.steps:
        checkpoints.save(train.steps)
    final = local_model(job, checkpoints.weights(), sample)
    scores = evaluate(job, final, eval_set)
    export_saved_model(final, sample, run_dir / "saved_model")
    metrics.write(
        {"event": "done", "steps": train.steps, **scores, "stale_dropped_total": stale_total, "wall_seconds": round(wall, 3)}
    )
    metrics.close()
    progress.message(
        f"pstrain: done in {wall:.1f}s; "
        + ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
        + f"; saved model in {run_dir / 'saved_model'}"
    )
    return 0


def stop_with_checkpoint(
    checkpoints: Checkpoints, step: int, stop: StopRequested, progress: Progress, metrics: MetricsLog
) -> int:
    """Save the state after `step` applied steps and exit as the stop signal asks."""
    checkpoints.save(step)
    name = signal.Signals(stop.signal).name
    progress.message(f"pstrain: stopped by {name} after step {step}; checkpoint saved, run the same command to resume")
    metrics.close()
    return 128 + stop.signal


def last_line(message: str) -> str:
    """TF wraps errors from traced code as "in user code: ... <the error>": keep the error."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def main_guarded(run_dir: Path, train: TrainConfig, standalone: bool) -> int:
    """Run, turning user mistakes and training errors into one-line messages."""
    from chief.jobs import JobError

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    log.setLevel(logging.INFO)
    tf.get_logger().setLevel(logging.WARNING)
    try:
        return run(run_dir, train, standalone)
    except JobError as e:
        print(f"pstrain: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"pstrain: error: {e}", file=sys.stderr)
        return 1
    except tf.errors.UnavailableError as e:
        first = e.message.splitlines()[0] if e.message else "unavailable"
        print(
            f"pstrain: error: a cluster task became unreachable ({first}); "
            "run the same command again to resume from the last checkpoint",
            file=sys.stderr,
        )
        return EXIT_RESTARTABLE
    except Exception as e:  # a job that raises: one line here, the traceback in the log dir
        if isinstance(e, tf.errors.OpError) and (data_error := explain_worker_error(e, [])):
            print(f"pstrain: error: {data_error}", file=sys.stderr)  # e.g. a data file missing here
            return 2
        trace = run_dir / "logs" / "chief-0.traceback"
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text(traceback.format_exc())
        print(f"pstrain: error: {type(e).__name__}: {last_line(str(e))} (traceback in {trace})", file=sys.stderr)
        return 1
