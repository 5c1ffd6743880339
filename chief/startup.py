"""A chief's start-up: the job, its data, the engine, the control-plane agent and the restore, in phases
between which a stop ends it (StoppedDuringStartup); what it hands the block loop (TrainingRun)."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from chief.contract.framework import variables_of
from chief.contract.job import Job, load_job
from chief.data.eval_set import EvalSet, eval_set
from chief.data.train_source import train_source
from chief.epochs import Epochs, epochs_for, pass_length
from chief.metrics import MetricsLog, Progress, learning_rate_fn
from chief.state.adapted import check_adapted
from chief.state.checkpoints import Checkpoints
from chief.state.route import open_checkpoints
from chief.state.sharding import placement_summary
from chief.step.dispatch import ClusterEngine, connect
from chief.step.engine import Engine
from chief.step.local import LocalEngine
from cluster.config import TrainConfig
from cluster.control.agent import Agent, agent_from_env
from cluster.errors import PstrainError, writing
from cluster.preflight import check_writable
from cluster.rundir import RunDir, note_start, read_records
from cluster.stop import StopTrap
from cluster.taskenv import Switches, TaskEnv, wait_until_ready
from cluster.tfconfig import chief_address, tf_config_text
from worker.input.lookups import lookups_on_workers

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


def start_agent(stop: StopTrap) -> Agent | None:
    """Register the chief with the control plane (when the launcher runs one) and heartbeat."""
    agent = agent_from_env("chief", 0, chief_address(tf_config_text()))
    if agent is None:
        return None
    agent.register(devices=[], deadline_s=30)

    def on_stop(reason: str, lost: bool) -> None:
        log.info("stopping: %s", reason)
        stop.request(signal.SIGTERM, cause="" if lost or not reason.startswith("pstrain stop") else reason)

    agent.start(on_stop)
    return agent


@dataclass
class TrainingRun:
    """What start-up hands the block loop and the finish: everything one run needs, and the counts kept between blocks."""

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
    epochs: Epochs | None = None  # training by epochs (chief/epochs.py): train.steps is theirs

    def banner(self, standalone: bool) -> str:
        t = self.train
        backups = t.total_num_replicas - t.replicas_to_aggregate
        return (
            f"pstrain: {'standalone' if standalone else 'cluster'} run of {self.job.spec}, steps {self.first_step}..{t.steps}, "
            f"global batch {t.global_batch_size} = {t.replicas_to_aggregate} x {t.slot_batch_size}"
            + (f", {backups} backup" if backups else "")
            + (f", {self.epochs.epochs} epochs of {self.epochs.steps_per_epoch} steps" if self.epochs else "")
        )


def start_run(
    run_dir: RunDir, train: TrainConfig, standalone: bool, stop: StopTrap, task_env: TaskEnv, switches: Switches
) -> TrainingRun:
    """Load the job, build the engine (the seed's initial weights), restore the latest checkpoint. `task_env`
    and `switches`: this process's environment, read by its entry point."""
    startup = StartupClock()
    check_writable(run_dir)  # before anything, the restore included: a run that could not save is refused now
    with writing(run_dir.path):
        note_start(run_dir, "chief")  # `done in` counts restarts (cluster/run_times.py)
    starts = read_records(run_dir.starts)  # read now: the run's times, whatever befalls the run dir
    stop_point(stop)
    if not wait_until_ready(train.startup_timeout + 30, stopped=lambda: stop.requested):
        stop_point(stop)
        raise PstrainError(f"the launcher did not report the cluster ready within {train.startup_timeout:g}s")
    joined = None if standalone else connect()  # before the job's module is imported (see connect)
    startup.mark("wait for the servers and join them")
    # A lookup table the job makes at import or in its first build of the data: a copy on each worker.
    with contextlib.nullcontext() if standalone else lookups_on_workers(joined[0]):
        job = load_job(train.job)
        source = train_source(job, run_dir, train)  # built again on each worker from its own files
    if epochs := epochs_for(train, *pass_length(source)):
        train = epochs.resolve(train)  # in steps from here on, on both engines alike
    evaluation = eval_set(job, source.first)
    sample = tf.nest.map_structure(np.asarray, source.first(1)[0])
    startup.mark("job and data")
    stop_point(stop)
    if standalone:
        engine: Engine = LocalEngine(job, train, source, sample)
    else:
        engine = ClusterEngine(job, train, source, sample, joined=joined, read_ahead=switches.read_ahead)
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
    progress = Progress(train.steps, first, tty=task_env.tty, epochs=epochs)
    run = TrainingRun(
        run_dir,
        train,
        job,
        engine,
        checkpoints,
        MetricsLog(
            run_dir,
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
