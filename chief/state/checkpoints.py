"""Checkpoints of the training state, written where its variables live.

The chief saves the live state with `tf.train.Checkpoint`: TF's multi-device saver runs one SaveV2 on
each ps for the variables (and shards) it holds, writing `ckpt-N_temp/part-*` there, and the chief
merges the index (MergeV2Checkpoints) beside its own small values (the save counter). So each ps
writes its own bytes and the chief holds no copy of the model. A variable split over ps tasks (a
`ShardedVariable`) is saved as slices of one full-size tensor under the key a whole variable has, so
a checkpoint restores into any number of shards (another ps count) and into a standalone model, and
one written by a standalone run (or by the chief's mirror, chief/state/mirror.py) restores into shards.

The save runs a function traced once, before the first step: tracing registers the function with every
task of the cluster, which a stalled worker would block; calling it later involves only the ps and the
chief (measured: a save with both workers SIGSTOPped took 0.06 s). Every ps must therefore reach the
checkpoint directory (one machine or a shared mount); chief/state/route.py checks that.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import tensorflow as tf
import tf_keras
from tensorflow.python.checkpoint import checkpoint_management

from chief.contract.framework import seed_states, variables_of
from chief.state.keras3_shards import slot_order
from chief.state.model_state import ModelState, finalize_layers
from cluster.errors import TrainingError, writing
from cluster.rundir import CHECKPOINT_STATE, checkpoint_name, checkpoint_prefixes, partial_saves

MAX_TO_KEEP = 3  # a damaged newest checkpoint still leaves at least two good ones to resume from
DAMAGED = "damaged"  # subdirectory where damaged checkpoints are moved, for inspection
# What reading a damaged checkpoint raises: TF's error classes vary with the damage ("file is too short
# to be an sstable" is a bare OpError). A ps that fails while restoring raises one of NETWORK_ERRORS:
# that is no damage, the checkpoint stays.
CORRUPT_ERRORS = (tf.errors.OpError, IndexError)
NETWORK_ERRORS = (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.DeadlineExceededError, tf.errors.AbortedError)


def say(text: str) -> None:
    print(text, flush=True)


def short_reason(error: BaseException) -> str:
    """An error's message on one line, without TF's `{{function_node ...}}` and `[Op:...]` wrapping."""
    text = re.sub(r"\{\{function_node [^}]*\}\}|\[Op:\w+\]", "", str(error))
    return " ".join(text.split())[:200]


def directory_identity(directory: Path) -> tuple[int, int] | None:
    """(device, inode) of `directory`, None when it does not exist yet."""
    try:
        found = directory.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino


def same_directory(directory: Path, identity: tuple[int, int] | None) -> None:
    """Raise ENOENT (a vanished run dir, to `writing`) when `directory` is no longer the one of `identity`."""
    if identity is not None and directory_identity(directory) != identity:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory (its file system is gone)", str(directory))


def files_of(prefix: Path) -> list[Path]:
    """The index and data files of one checkpoint."""
    return sorted(prefix.parent.glob(prefix.name + ".*"))


def remove_partial_saves(directory: Path) -> list[Path]:
    """Delete what an interrupted save left (cluster/rundir.py's `partial_saves`); returns them."""
    leftovers = partial_saves(directory)
    for path in leftovers:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    return leftovers


def damaged_file(prefix: Path) -> Path:
    """Which file of a checkpoint that failed to restore is damaged: the index if it cannot be read, else its data."""
    try:
        tf.train.load_checkpoint(str(prefix))
    except Exception:
        return prefix.with_name(prefix.name + ".index")
    data = [p for p in files_of(prefix) if ".data-" in p.name]
    return data[0] if len(data) == 1 else prefix.with_name(prefix.name + ".data-*")


def checkpointed_variables(state: ModelState) -> list[tf.Variable]:
    """Everything a checkpoint holds, in an order both copies share. A new-style optimizer lists the
    slots of a sharded variable as one `ShardedVariable`: its shards are listed instead; a Keras 3
    optimizer's slots of shards are listed together (chief/state/keras3_shards.py `slot_order`)."""
    optimizer = state.optimizer.variables
    optimizer = slot_order(state.optimizer, state.model.trainable_variables, optimizer() if callable(optimizer) else optimizer)
    optimizer = [shard for v in variables_of(optimizer) for shard in getattr(v, "variables", [v])]
    return [*variables_of(state.model.weights), *seed_states(state.model), *optimizer, state.global_step]


class Checkpoints:
    """Save and restore `live` (the training state, on the ps or in this process) in `directory`, keeping
    the newest MAX_TO_KEEP complete checkpoints."""

    def __init__(self, live: ModelState, directory: Path, say: Callable[[str], None] = say):
        self.live, self.directory, self.say = live, directory, say
        self._checkpoint = live.checkpoint()
        self._checkpoint.save_counter  # noqa: B018 (the chief's own small value, created before the save is traced)
        self._save_fn = None
        self._identity = directory_identity(directory)  # a save checks the run dir is still this one

    def prepare(self) -> None:
        """Trace the save now, while every task answers (a new function is registered with all of them)."""
        if self._save_fn is None:
            checkpoint = self._checkpoint
            spec = [tf.TensorSpec([], tf.string)]
            self._save_fn = tf.function(lambda prefix: checkpoint.write(prefix), input_signature=spec).get_concrete_function()

    @property
    def latest(self) -> str | None:
        return tf.train.latest_checkpoint(str(self.directory))

    def restore_latest(self) -> int:
        """Load the newest checkpoint that restores into the training state; returns its global step
        (0 if none). A damaged one (truncated, garbled) is moved to `damaged/`, said, and the one
        before it tried; leftovers of an interrupted save are deleted first."""
        remove_partial_saves(self.directory)
        prefixes = checkpoint_prefixes(self.directory)
        damaged: list[Path] = []
        for prefix in reversed(prefixes):
            try:
                self._restore(prefix)
            except NETWORK_ERRORS:
                raise
            except CORRUPT_ERRORS as e:
                bad = damaged_file(prefix)
                self.say(f"pstrain: warning: checkpoint file {bad} is damaged ({short_reason(e)}); trying the one before")
                damaged.append(prefix)
                continue
            self._forget(damaged, prefixes)
            step = int(self.live.global_step.numpy())
            if damaged:
                self.say(f"pstrain: warning: resuming from {prefix} at step {step}")
            self.prepare()
            return step
        if damaged:
            self._forget(damaged, prefixes)
            raise TrainingError(
                f"every checkpoint in {self.directory} is damaged (moved to {self.directory / DAMAGED}); "
                "use a new --run-dir, or move that directory away to start from step 0"
            )
        self.prepare()
        return 0

    def _restore(self, prefix: Path) -> None:
        """Read checkpoint `prefix` into the state: each ps reads its own variables' slices."""
        self._checkpoint.restore(str(prefix)).assert_existing_objects_matched()
        if not _on_ps(self.live):
            finalize_layers(self.live.model)  # a standalone model re-derives its layers' tensors (Normalization)

    def _forget(self, damaged: list[Path], prefixes: list[Path]) -> None:
        """Move damaged checkpoints aside and list only the good ones in the `checkpoint` state file."""
        if not damaged:
            return
        (self.directory / DAMAGED).mkdir(exist_ok=True)
        for prefix in damaged:
            for path in files_of(prefix):
                path.replace(self.directory / DAMAGED / path.name)
        good = [p.name for p in prefixes if p not in damaged]  # relative, as CheckpointManager writes them
        if good:
            write_listing(self.directory, good[-1], good)
        else:
            (self.directory / CHECKPOINT_STATE).unlink(missing_ok=True)

    def sync(self) -> None:
        """Nothing to copy: evaluation and export read the training state itself."""

    def model(self) -> tf_keras.Model:
        """The model evaluation and export read: the training state's own (its variables on the ps)."""
        return self.live.model

    def save(self, step: int) -> None:
        """Write checkpoint `step` of the training state (between steps); only a complete one (its index
        written) becomes the latest, and the oldest beyond MAX_TO_KEEP are deleted. The directory must be
        the one the run started with: one whose file system was unmounted under the run would otherwise be
        made again, silently, on the file system below."""
        prefix = self.directory / checkpoint_name(step)
        try:
            with writing(prefix):  # no space, no permission (a ps's too), read-only or gone: one line with the fix
                same_directory(self.directory, self._identity)  # before mkdir, which would make it anew on the mount point
                self.directory.mkdir(parents=True, exist_ok=True)
                self._write(prefix)
        except BaseException:
            with suppress(OSError):  # a read-only or vanished directory keeps its leftovers: the write's error is the news
                remove_partial_saves(self.directory)
            raise
        with writing(self.directory / CHECKPOINT_STATE):  # the disk may turn read-only between the write and the listing
            kept = checkpoint_prefixes(self.directory)
            for old in kept[:-MAX_TO_KEEP]:
                for path in files_of(old):
                    path.unlink(missing_ok=True)
            names = [p.name for p in kept[-MAX_TO_KEEP:]]
            write_listing(self.directory, prefix.name, names)

    def _write(self, prefix: Path) -> None:
        self.prepare()
        self._save_fn(tf.constant(str(prefix)))


def write_listing(directory: Path, latest: str, names: list[str]) -> None:
    """Write `directory/checkpoint` (atomically): `latest` and every kept checkpoint `names`. What
    `tf.compat.v1.train.update_checkpoint_state` writes, without its deprecation warning on the console.
    The names stay relative to `directory`, as TF's readers take them (`tf.train.latest_checkpoint`); given a
    relative directory, TF would write them relative to the working directory instead ("../../ckpt-60")."""
    checkpoint_management.update_checkpoint_state_internal(
        str(directory.absolute()), latest, all_model_checkpoint_paths=names, save_relative_paths=False
    )


def _on_ps(state: ModelState) -> bool:
    return any("/job:ps" in v.device for v in checkpointed_variables(state))
