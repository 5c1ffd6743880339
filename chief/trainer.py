"""The training loop shared by cluster and standalone runs, and its entry point's error handling: start-up
(chief/startup.py), the block loop (chief/blocks.py), the finish (chief/finish.py).

run = start_run(...)                           # job, engine, control-plane agent, restore, banner
step = run.first_step
while step < train.steps:
    count = block_length(step, train, first)   # up to steps_per_execution and ~2 s, never past a checkpoint or eval
    results = engine.run(step, count)          # synchronous updates, N gradients each, one dispatch
    record(run, step, results)                 # metrics.jsonl (a line per step), progress, heartbeat report
    step += len(results)
    maybe_checkpoint(run, step)                # every checkpoint_every steps
    maybe_evaluate(run, step)                  # every eval_every steps
    if stop requested: stop_with_checkpoint and exit 128+N
finish(run, step)                              # final checkpoint, evaluation, SavedModel, done line
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from pathlib import Path

import tensorflow as tf

from chief.blocks import block_length, maybe_checkpoint, maybe_evaluate, record
from chief.callbacks import fit_callbacks
from chief.contract.job import job_file
from chief.data.train_source import explain_worker_error
from chief.finish import finish, say_stopped, stop_with_checkpoint
from chief.startup import StoppedDuringStartup, start_run
from chief.state.checkpoints import remove_partial_saves
from cluster.config import TrainConfig
from cluster.errors import (
    EXIT_FAILURE,
    PstrainError,
    RestartableError,
    UserCodeError,
    WriteError,
    report,
    user_error,
    write_error,
)
from cluster.rundir import RunDir, latest_checkpoint_step
from cluster.stop import StopTrap
from cluster.taskenv import Switches, TaskEnv

log = logging.getLogger("pstrain.chief")
KEPT: list = []  # the runs, never freed: freeing a cluster run's functions waits on workers that may wait on the ps forever


def run(run_dir: RunDir, train: TrainConfig, standalone: bool, stop: StopTrap, task_env: TaskEnv, switches: Switches) -> int:
    """Train to `train.steps` (resuming from the latest checkpoint); returns the exit code. A stop
    (`stop`, entered by the caller as early as it can) ends start-up between its phases, and training
    at the next step boundary with a checkpoint."""
    try:
        run = start_run(run_dir, train, standalone, stop, task_env, switches)
        if not standalone:
            KEPT.append(run)  # `python -m chief` ends by os._exit
    except StoppedDuringStartup:
        say_stopped(stop, latest_checkpoint_step(run_dir), "start-up", standalone, run_dir=run_dir)
        return stop.exit_code
    train, callbacks = run.train, fit_callbacks(run)  # train: with train.epochs, in steps
    callbacks.begin(run.first_step)
    step, step_seconds = run.first_step, None
    while step < train.steps:
        if stop.requested:  # before each block: a stop never waits for one to run
            log.info("stop noticed at step %d, between blocks", step)
            return stop_with_checkpoint(run, step, stop, standalone)
        t0 = time.monotonic()
        count = callbacks.cut(step, block_length(step, train, run.first_step, step_seconds))
        if step == run.first_step:
            log.info("first block starting at step %d (%d steps)", step, count)
        results = run.engine.run(step, count, interrupted=lambda: stop.requested)
        seconds = time.monotonic() - t0
        record(run, step, results, seconds)
        # The run's first step traces every function: the blocks are sized from warm ones.
        step_seconds = seconds / max(len(results), 1) if step > run.first_step else None
        step += len(results)
        maybe_checkpoint(run, step)
        if callbacks.after_block(step - len(results), [r.loss for r in results], maybe_evaluate(run, step)):
            run.progress.message(f"pstrain: a callback set stop_training: the run ends after step {step} of {train.steps}")
            break
    if stop.requested:
        return stop_with_checkpoint(run, step, stop, standalone)
    callbacks.end(step)
    return finish(run, step)


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


def main_guarded(
    run_dir: RunDir, train: TrainConfig, standalone: bool, task_env: TaskEnv, switches: Switches, stop: StopTrap | None = None
) -> int:
    """Run, turning user mistakes and training errors into one-line messages and exit codes. `task_env`,
    `switches`: this process's environment, read once by the entry point; `stop`: the caller's stop trap,
    entered before the imports (else one is entered here)."""
    if stop is None:
        with StopTrap() as stop:
            return main_guarded(run_dir, train, standalone, task_env, switches, stop)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    log.setLevel(logging.INFO)
    tf.get_logger().setLevel(logging.WARNING)
    try:
        try:
            return run(run_dir, train, standalone, stop, task_env, switches)
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
