"""The block loop: how many steps each dispatch runs, and the bookkeeping after each block (a line per
step, progress, the heartbeat's report, checkpoints and evaluations at their steps)."""

from __future__ import annotations

import logging
import time

from chief.scores import evaluate
from chief.startup import TrainingRun
from chief.step.engine import StepResult
from cluster.config import TrainConfig
from cluster.control.agent import Report
from cluster.errors import TrainingError

log = logging.getLogger("pstrain.chief")

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


def record(run: TrainingRun, first: int, results: list[StepResult], seconds: float) -> None:
    """Log a block's steps (`seconds` is the block's time, shared evenly); a withheld (non-finite) step
    under on_nonfinite "stop" is checkpointed before it and ends the run."""
    per_step = seconds / max(len(results), 1)
    for step, result in enumerate(results, first):
        run.stale_total += result.stale_dropped
        if not result.applied and run.train.on_nonfinite == "stop":
            run.checkpoints.save(step)  # the state before the bad step; its update was withheld
            run.metrics.flush()
            what = (
                f"loss is {result.loss}"
                if result.nonfinite == "loss"
                else f"the mean gradient of {result.nonfinite} is not finite (loss {result.loss})"
            )
            raise TrainingError(
                f"step {step}: {what}; stopped without applying it, checkpoint at step {step} "
                '(lower the learning rate, check the data, or set train.on_nonfinite = "skip")'
            )
        run.metrics.write(
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
                **({"epoch": run.epochs.epoch_of(step)} if run.epochs else {}),
                **({"epoch": result.epoch} if result.epoch is not None and not run.epochs else {}),
                **({"reread": result.reread} if result.reread is not None else {}),
            }
        )
        examples_per_s = run.train.global_batch_size / max(per_step, 1e-9)
        run.progress.update(step, result.loss, examples_per_s, result.aggregated, per_step)
        for worker in result.workers:
            run.gradients_by_worker[worker] = run.gradients_by_worker.get(worker, 0) + 1
    if run.agent and results:
        run.agent.report = Report("training", first + len(results), dict(run.gradients_by_worker))
    if first == run.first_step:  # the run's first block is its first step
        run.startup.mark("first step")
        log.info("start-up: %s", run.startup.summary())


def maybe_checkpoint(run: TrainingRun, done: int) -> None:
    every = run.train.checkpoint_every
    if every and done % every == 0 and done < run.train.steps:
        run.checkpoints.save(done)
        run.saved = done
        run.metrics.flush()  # TensorBoard events on disk with each checkpoint


def maybe_evaluate(run: TrainingRun, done: int) -> dict[str, float] | None:
    """Every `eval_every` steps: evaluate the model after `done` steps (the training state itself, read
    from the ps; the chief's mirror where it keeps one), training waiting as long as this takes, and
    write an eval line."""
    every = run.train.eval_every
    if not every or done % every:
        return None
    run.checkpoints.sync()
    scores = evaluate(run.job, run.checkpoints.model(), run.eval_set)
    run.metrics.write({"event": "eval", "step": done, **scores})
    log.info("eval at step %d: %s", done, ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
    return scores
