"""Jobs with `callbacks_fn()` (chief/callbacks.py, tests/chief/test_callbacks.py): the digits job plus
callbacks, named `--job tests.jobs.callbacks:<name>`. Files the callbacks write go to $PSTRAIN_CALLBACKS_DIR."""

from __future__ import annotations

import json
import os
from pathlib import Path

import tf_keras

from chief.jobs import digits


def out(name: str) -> str:
    """`name` in $PSTRAIN_CALLBACKS_DIR, which the tests set; without it, nowhere (it once wrote an empty
    hooks.jsonl into the directory a run was started from: the repository's root)."""
    where = os.environ.get("PSTRAIN_CALLBACKS_DIR")
    return str(Path(where) / name) if where else os.devnull


class Hooks(tf_keras.callbacks.Callback):
    """A user's own callback: writes each hook it sees (and the learning rate at each epoch's start) to
    hooks.jsonl, and sets stop_training after batch `stop_at` of epoch 1 when given."""

    def __init__(self, stop_at: int | None = None):
        super().__init__()
        self.stop_at, self.file = stop_at, open(out("hooks.jsonl"), "a", buffering=1)
        self.epoch = 0

    def _write(self, *record) -> None:
        self.file.write(json.dumps(record) + "\n")

    def on_train_begin(self, logs=None):
        self._write("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self._write("epoch_begin", epoch, float(tf_keras.backend.get_value(self.model.optimizer.lr)))

    def on_train_batch_end(self, batch, logs=None):
        self._write("batch_end", batch, logs["loss"])
        if self.stop_at is not None and self.epoch == 1 and batch == self.stop_at:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self._write("epoch_end", epoch, sorted(logs))

    def on_train_end(self, logs=None):
        self._write("train_end")


class Base:
    model_fn, loss_fn, optimizer_fn = (
        staticmethod(digits.model_fn),
        staticmethod(digits.loss_fn),
        staticmethod(digits.optimizer_fn),
    )
    train_data, eval_data = staticmethod(digits.train_data), staticmethod(digits.eval_data)


class early(Base):
    """EarlyStopping on an eval metric that stops after epoch 1 and restores epoch 0's weights (val_loss
    falls each epoch: in mode "max" the first epoch is the best)."""

    @staticmethod
    def callbacks_fn():
        return [tf_keras.callbacks.EarlyStopping(monitor="val_loss", mode="max", patience=1, restore_best_weights=True)]


class schedules(Base):
    """The learning rate halved at each epoch's start after the first, and cut by ReduceLROnPlateau when
    val_accuracy does not rise above 1 (always): both change the rate the ps applies. CSVLogger, TerminateOnNaN,
    a user callback, and what pstrain replaces (ModelCheckpoint, TensorBoard)."""

    @staticmethod
    def callbacks_fn():
        return [
            tf_keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr if epoch == 0 else lr * 0.5),
            tf_keras.callbacks.ReduceLROnPlateau(monitor="val_accuracy", mode="max", patience=0, factor=0.8, min_delta=1.0),
            tf_keras.callbacks.CSVLogger(out("log.csv")),
            tf_keras.callbacks.TerminateOnNaN(),
            tf_keras.callbacks.ModelCheckpoint(out("never.h5")),
            tf_keras.callbacks.TensorBoard(out("never")),
            Hooks(),
        ]


class stops(Base):
    """A user callback that sets stop_training after batch 8 of epoch 1."""

    @staticmethod
    def callbacks_fn():
        return [Hooks(stop_at=8)]


class PerBatchRate(tf_keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        tf_keras.backend.set_value(self.model.optimizer.lr, 1e-3 / (batch + 2))  # from the first step on


class per_batch(Base):
    """A per-batch learning-rate change: refused (batch hooks run after a block)."""

    @staticmethod
    def callbacks_fn():
        return [PerBatchRate()]


class tests_eval(Base):
    """A callback with a hook pstrain never calls: refused at load."""

    @staticmethod
    def callbacks_fn():
        class OnTest(tf_keras.callbacks.Callback):
            def on_test_batch_end(self, batch, logs=None):
                pass

        return [OnTest()]


class nan(Base):
    """Ten training images with a NaN pixel: a step that reads one has a NaN loss. With
    --on-nonfinite skip, TerminateOnNaN ends the run (pstrain's default, stop, ends it itself)."""

    @staticmethod
    def train_data():
        x, y = digits.train_data()
        x = x.copy()
        x[::140, 0, 0, 0] = float("nan")
        return x, y

    @staticmethod
    def callbacks_fn():
        return [tf_keras.callbacks.TerminateOnNaN()]
