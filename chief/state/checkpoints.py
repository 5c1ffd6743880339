"""Checkpoints written from a local mirror of the training state.

Saving a ParameterServerStrategy model directly traces a new tf.function for every save, and
registering it contacts every worker: one stalled worker would then block the save that a stop
needs. Instead the chief reads the variables from the ps (plain eager reads, only the ps involved)
into a local copy of the same model and optimizer, and saves that. Checkpoints are therefore the
same format for cluster and standalone runs, full-size whatever the sharding.

The mirror is the one full copy of the state on the chief. It is made at the first save, restore or
evaluation, unfilled (no initializer runs; its memory is taken as values are written), and values
move between it and the ps in row chunks (chief/state/sharding.py `copy_rows`), so the chief never holds
a second full-size value beside it. Evaluation and export use the mirror's model, not another copy.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import tensorflow as tf
import tf_keras

from chief.job import Job
from chief.state.model_state import ModelState, finalize_layers, mirror_state, variables_of
from chief.state.sharding import copy_rows, shard_groups
from cluster.errors import TrainingError, writing

MAX_TO_KEEP = 3  # a damaged newest checkpoint still leaves at least two good ones to resume from
DAMAGED = "damaged"  # subdirectory where damaged checkpoints are moved, for inspection
_STEP = re.compile(r"ckpt-(\d+)\.index$")
# What a truncated or garbled checkpoint raises on restore (a checksum error, a short read).
# What reading a damaged checkpoint raises: TF's error classes vary with the damage ("file is too short
# to be an sstable" is a bare OpError); the mirror is a local copy, so no error here is a network's.
CORRUPT_ERRORS = (tf.errors.OpError, IndexError)


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


def checkpoint_prefixes(directory: Path) -> list[Path]:
    """Every complete checkpoint's prefix (RUN_DIR/checkpoints/ckpt-N) in `directory`, oldest first."""
    found = [(int(m.group(1)), p) for p in directory.glob("ckpt-*.index") if (m := _STEP.search(p.name))]
    return [p.with_suffix("") for _, p in sorted(found)]


def files_of(prefix: Path) -> list[Path]:
    """The index and data files of one checkpoint."""
    return sorted(prefix.parent.glob(prefix.name + ".*"))


def remove_partial_saves(directory: Path) -> list[Path]:
    """Delete what an interrupted save left (`ckpt-N_temp` files and directories); returns them."""
    leftovers = sorted(directory.glob("*_temp*"))
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
    slots of a sharded variable as one `ShardedVariable`: its shards are listed instead."""
    optimizer = state.optimizer.variables
    optimizer = [shard for v in (optimizer() if callable(optimizer) else optimizer) for shard in getattr(v, "variables", [v])]
    return [*variables_of(state.model.weights), *optimizer, state.global_step]


class Checkpoints:
    """Save and restore `live` (the training state) in `directory`; `local`: a standalone run, whose
    live state is in this process and is saved as it is."""

    def __init__(self, live: ModelState, job: Job, sample, directory: Path, local: bool, say: Callable[[str], None] = say):
        self.live = live
        self.job, self.sample, self.directory, self.say = job, sample, directory, say
        self._mirror: ModelState | None = live if local else None
        self._manager: tf.train.CheckpointManager | None = None
        self.pairs: list[tuple[list[tf.Variable], tf.Variable]] = []  # (shards of a live variable, its mirror)
        self._identity = directory_identity(directory)

    def _ensure_mirror(self) -> tuple[ModelState, bool]:
        """The mirror, and whether it was made just now (then its values are not the state's yet)."""
        if self._mirror is not None:
            return self._mirror, False
        mirror = mirror_state(self.job, self.sample)
        live_vars, mirror_vars = checkpointed_variables(self.live), checkpointed_variables(mirror)
        try:  # a variable sharded across ps tasks is one full-size variable in the mirror
            groups = shard_groups([v.shape for v in live_vars], [v.shape for v in mirror_vars])
        except ValueError as e:
            raise RuntimeError(f"the local checkpoint mirror does not match the training state: {e}") from None
        self.pairs = [([live_vars[i] for i in group], m) for group, m in zip(groups, mirror_vars, strict=True)]
        self._mirror = mirror
        return mirror, True

    @property
    def manager(self) -> tf.train.CheckpointManager:
        if self._manager is None:
            mirror, _ = self._ensure_mirror()
            self._manager = tf.train.CheckpointManager(mirror.checkpoint(), str(self.directory), max_to_keep=MAX_TO_KEEP)
        return self._manager

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
            mirror, _ = self._ensure_mirror()
            try:
                mirror.checkpoint().restore(str(prefix)).assert_existing_objects_matched()
            except CORRUPT_ERRORS as e:
                bad = damaged_file(prefix)
                self.say(f"pstrain: warning: checkpoint file {bad} is damaged ({short_reason(e)}); trying the one before")
                damaged.append(prefix)
                continue
            self._forget(damaged, prefixes)
            for shards, full in self.pairs:
                copy_rows([full], shards)
            # The mirror's layers recompute what they derive from their weights. The live model's came from
            # the same model_fn on the same data (a Normalization's adapt), so they hold already.
            finalize_layers(mirror.model)
            step = int(self.live.global_step.numpy())
            if damaged:
                self.say(f"pstrain: warning: resuming from {prefix} at step {step}")
            return step
        if damaged:
            self._forget(damaged, prefixes)
            raise TrainingError(
                f"every checkpoint in {self.directory} is damaged (moved to {self.directory / DAMAGED}); "
                "use a new --run-dir, or move that directory away to start from step 0"
            )
        return 0

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
            tf.compat.v1.train.update_checkpoint_state(str(self.directory), good[-1], all_model_checkpoint_paths=good)
        else:
            (self.directory / "checkpoint").unlink(missing_ok=True)

    def sync(self) -> None:
        """Copy the training state (between steps) into the local mirror."""
        mirror, _ = self._ensure_mirror()
        for shards, full in self.pairs:
            copy_rows(shards, [full])
        finalize_layers(mirror.model)

    def model(self) -> tf_keras.Model:
        """The model as of the last save, restore or sync (synced now if there was none yet): what
        evaluation and export read."""
        mirror, fresh = self._ensure_mirror()
        if fresh:
            self.sync()
        return mirror.model

    def save(self, step: int) -> None:
        """Snapshot the training state (between steps) and write checkpoint `step`. The directory must be
        the one the run started with: one whose file system was unmounted under the run would otherwise be
        made again, silently, on the file system below."""
        self.sync()
        path = self.directory / f"ckpt-{step}"
        with writing(path):
            same_directory(self.directory, self._identity)
            self.manager.save(checkpoint_number=step)
