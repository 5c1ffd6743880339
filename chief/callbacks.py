"""A job's `callbacks_fn()`: fresh `tf_keras.callbacks`, run on the chief with the logs `fit` gives.

Granularity (docs/jobs.md):
- `on_train_begin` / `on_train_end` once per start of the chief (a resume starts them afresh: a
  callback's own state, such as EarlyStopping's patience, is not in the checkpoint);
- `on_epoch_begin(epoch)` before the epoch's first block, `on_epoch_end(epoch, logs)` after its last,
  logs `loss` (the epoch's mean step loss) and, when an evaluation ran at that step, its scores named
  `val_<name>` as fit names them. Blocks end at epoch edges. An epoch is `train.epochs`' epoch
  (chief/epochs.py); training by steps, it is `eval_every` steps (Keras's `steps_per_epoch`), else the run;
- `on_train_batch_begin/end(batch, logs)` once per step, in order, after the block's steps were applied
  (logs `loss`: the epoch's running mean, as fit's). A batch hook that changes the learning rate is
  refused: it would take effect only at the block's end. Change it at epoch edges (LearningRateScheduler,
  ReduceLROnPlateau do) or use a LearningRateSchedule (exact per step).

`self.model` is the training model (on a cluster its variables live on the ps: get_weights/set_weights
read and write them there), with fit's `optimizer` (the training optimizer: its learning rate is a
variable on the ps, set between blocks) and `stop_training` (the run stops at the block's end, with a
checkpoint). ModelCheckpoint, BackupAndRestore, TensorBoard and ProgbarLogger are accepted and not run:
one line says what pstrain does instead. Hooks pstrain never calls (on_test_*, on_predict_*) are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import tensorflow as tf
import tf_keras

from chief.contract.job import Job, JobError
from chief.metrics import learning_rate_fn
from cluster.errors import TrainingError

INSTEAD = {
    "ModelCheckpoint": "pstrain checkpoints the whole training state in RUN_DIR/checkpoints every train.checkpoint_every "
    "steps (--checkpoint-every epoch) and exports RUN_DIR/saved_model at the end",
    "BackupAndRestore": "pstrain resumes from RUN_DIR/checkpoints when the same command runs again",
    "TensorBoard": "pstrain writes TensorBoard events of every step and evaluation to RUN_DIR/tensorboard",
    "ProgbarLogger": "pstrain prints its own progress line",
}
NEVER_CALLED = tuple(
    f"on_{phase}_{edge}" for phase in ("test", "predict") for edge in ("begin", "end", "batch_begin", "batch_end")
)


def job_callbacks(job: Job, say: Callable[[str], None]) -> list[tf_keras.callbacks.Callback]:
    """The callbacks of `job.callbacks_fn()` that pstrain runs; says one line for each it replaces, and
    refuses (JobError, one line) what is not a callback or overrides a hook pstrain never calls."""
    if job.callbacks_fn is None:
        return []
    made = job.callbacks_fn()
    where = f"--job {job.spec}: callbacks_fn()"
    if not isinstance(made, (list, tuple)):
        raise JobError(f"{where} must return a list of tf_keras.callbacks.Callback objects, found {type(made).__name__}")
    kept = []
    for callback in made:
        name = type(callback).__name__
        if not isinstance(callback, tf_keras.callbacks.Callback):
            raise JobError(f"{where}: {name} is not a tf_keras.callbacks.Callback (from keras 3? use tf_keras.callbacks)")
        if name in INSTEAD and type(callback).__module__.startswith("tf_keras"):
            say(f"pstrain: note: {name} is not run: {INSTEAD[name]}")
            continue
        hooks = [h for h in NEVER_CALLED if getattr(type(callback), h) is not getattr(tf_keras.callbacks.Callback, h)]
        if hooks:
            raise JobError(
                f"{where}: {name} overrides {', '.join(hooks)}, which pstrain never calls (its evaluations run no "
                "callbacks); use on_epoch_end's val_ logs instead"
            )
        kept.append(callback)
    return kept


class FitModel:
    """A callback's `self.model`: the training model, plus fit's `optimizer` and `stop_training`."""

    def __init__(self, model: tf_keras.Model, optimizer: Any):
        object.__setattr__(self, "_model", model)
        self.optimizer, self.stop_training = optimizer, False

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_model"), name)


class FitCallbacks:
    """Drives the callbacks from the training loop: `begin`, `cut` (blocks end at epoch edges),
    `after_block` (batch and epoch hooks; True: stop_training), `end`."""

    def __init__(self, callbacks: list, model: FitModel, steps_per_epoch: int, total_steps: int, on_lr_change=None):
        self.callbacks, self.model = tf_keras.callbacks.CallbackList(callbacks), model
        self.callbacks._check_timing = False  # its "slow compared to the batch time" warns of hooks run after a block
        self.active = bool(callbacks)
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.on_lr_change = on_lr_change or (lambda: None)
        self.losses: list[float] = []  # this epoch's step losses so far
        epochs = math.ceil(total_steps / steps_per_epoch)
        self.callbacks.set_model(model)
        self.callbacks.set_params({"epochs": epochs, "steps": steps_per_epoch, "verbose": 0})

    def _lr(self) -> float | None:
        return learning_rate_fn(self.model.optimizer)(0)

    def begin(self, first_step: int) -> None:
        """`on_train_begin`, then `on_epoch_begin` of the epoch `first_step` is in. A resume mid-epoch
        keeps the checkpoint's learning rate, which that epoch's `on_epoch_begin` already set before the
        save: a schedule that scales the current rate (`lr * 0.5`) must not apply twice."""
        if not self.active:
            return
        self.callbacks.on_train_begin({})
        rate = self.model.optimizer.learning_rate
        kept = rate.numpy() if isinstance(rate, tf.Variable) and first_step % self.steps_per_epoch else None
        self.callbacks.on_epoch_begin(first_step // self.steps_per_epoch, {})
        if kept is not None:
            rate.assign(kept)
        self.on_lr_change()

    def cut(self, step: int, count: int) -> int:
        """`count` cut so the block ends at the epoch's end (only with callbacks)."""
        if not self.active:
            return count
        return min(count, (step // self.steps_per_epoch + 1) * self.steps_per_epoch - step)

    def after_block(self, first: int, losses: list[float], scores: dict[str, float] | None) -> bool:
        """Hooks for the block of steps `first`.. (their losses), `scores` the evaluation after it (or
        None); returns whether a callback set `stop_training`."""
        if not self.active:
            return False
        rate = self._lr()
        for step, loss in enumerate(losses, first):
            batch = step % self.steps_per_epoch
            self.losses.append(loss)
            self.callbacks.on_train_batch_begin(batch, {})
            self.callbacks.on_train_batch_end(batch, {"loss": sum(self.losses) / len(self.losses)})
        if self._lr() != rate:
            raise TrainingError(
                f"callbacks_fn(): a batch hook changed the learning rate at step {first + len(losses) - 1}; pstrain runs batch "
                "hooks after a block's steps, so it would not apply there: change it in on_epoch_begin/on_epoch_end "
                "(as LearningRateScheduler does) or give the optimizer a LearningRateSchedule"
            )
        done = first + len(losses)
        if done % self.steps_per_epoch == 0 or done == self.total_steps:
            epoch = (done - 1) // self.steps_per_epoch
            val = {f"val_{k.removeprefix('eval_')}": v for k, v in (scores or {}).items()}
            self.callbacks.on_epoch_end(epoch, {"loss": sum(self.losses) / max(len(self.losses), 1), **val})
            self.losses = []
            if done < self.total_steps and not self.model.stop_training:
                self.callbacks.on_epoch_begin(epoch + 1, {})
            self.on_lr_change()
        return bool(self.model.stop_training)

    def end(self, done: int) -> None:
        if self.active:
            self.callbacks.on_train_end({"loss": self.losses[-1]} if self.losses else {})


def fit_callbacks(run) -> FitCallbacks:
    """The job's callbacks over a started TrainingRun (chief/startup.py); inactive without callbacks_fn."""
    t, state = run.train, run.engine.state
    steps_per_epoch = run.epochs.steps_per_epoch if run.epochs else (t.eval_every or t.steps)

    def refresh_rate() -> None:  # metrics.jsonl's learning_rate: a callback may have set it
        run.metrics.learning_rate = learning_rate_fn(state.optimizer)

    callbacks = job_callbacks(run.job, run.progress.message)
    check_monitored(run.job.spec, callbacks, steps_per_epoch, t.eval_every)
    return FitCallbacks(callbacks, FitModel(state.model, state.optimizer), steps_per_epoch, t.steps, refresh_rate)


def check_monitored(spec: str, callbacks: list, steps_per_epoch: int, eval_every: int) -> None:
    """A callback that monitors a `val_` metric needs an evaluation at every epoch's end: without one it
    would only warn each epoch (as fit does without validation data) and never act. Refused in one line."""
    for callback in callbacks:
        monitor = getattr(callback, "monitor", None)
        if isinstance(monitor, str) and monitor.startswith("val_") and (not eval_every or steps_per_epoch % eval_every):
            raise JobError(
                f"--job {spec}: callbacks_fn(): {type(callback).__name__} monitors {monitor}, but no evaluation runs at "
                'each epoch\'s end; add --eval-every epoch (train.eval_every = "epoch")'
            )
