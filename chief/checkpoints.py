"""Checkpoints written from a local mirror of the training state.

Saving a ParameterServerStrategy model directly traces a new tf.function for every save, and
registering it contacts every worker: one stalled worker would then block the save that a stop
needs. Instead the chief reads the variables from the ps (plain eager reads, only the ps involved)
into a local copy of the same model and optimizer, and saves that. Checkpoints are therefore the
same format for cluster and standalone runs, full-size whatever the sharding.

The mirror is the one full copy of the state on the chief. It is made at the first save, restore or
evaluation, unfilled (no initializer runs; its memory is taken as values are written), and values
move between it and the ps in row chunks (chief/sharding.py `copy_rows`), so the chief never holds
a second full-size value beside it. Evaluation and export use the mirror's model, not another copy.
"""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf
import tf_keras

from chief.jobs import Job
from chief.model_state import ModelState, mirror_state
from chief.sharding import copy_rows, shard_groups

MAX_TO_KEEP = 3


def state_variables(state: ModelState) -> list[tf.Variable]:
    """Everything a checkpoint holds, in an order both copies share. A new-style optimizer lists the
    slots of a sharded variable as one `ShardedVariable`: its shards are listed instead."""
    optimizer = state.optimizer.variables
    optimizer = [shard for v in (optimizer() if callable(optimizer) else optimizer) for shard in getattr(v, "variables", [v])]
    return [*state.model.weights, *optimizer, state.global_step]


class Checkpoints:
    """Save and restore `live` (the training state) in `directory`; `local`: a standalone run, whose
    live state is in this process and is saved as it is."""

    def __init__(self, live: ModelState, job: Job, sample, directory: Path, local: bool):
        self.live = live
        self.job, self.sample, self.directory = job, sample, directory
        self._mirror: ModelState | None = live if local else None
        self._manager: tf.train.CheckpointManager | None = None
        self.pairs: list[tuple[list[tf.Variable], tf.Variable]] = []  # (shards of a live variable, its mirror)

    def _ensure_mirror(self) -> tuple[ModelState, bool]:
        """The mirror, and whether it was made just now (then its values are not the state's yet)."""
        if self._mirror is not None:
            return self._mirror, False
        mirror = mirror_state(self.job, self.sample)
        live_vars, mirror_vars = state_variables(self.live), state_variables(mirror)
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
        """Load the latest checkpoint into the training state; returns its global step (0 if none)."""
        latest = self.latest
        if latest:
            mirror, _ = self._ensure_mirror()
            mirror.checkpoint().restore(latest).assert_existing_objects_matched()
            for shards, full in self.pairs:
                copy_rows([full], shards)
        return int(self.live.global_step.numpy())

    def sync(self) -> None:
        """Copy the training state (between steps) into the local mirror."""
        self._ensure_mirror()
        for shards, full in self.pairs:
            copy_rows(shards, [full])

    def model(self) -> tf_keras.Model:
        """The model as of the last save, restore or sync (synced now if there was none yet): what
        evaluation and export read."""
        mirror, fresh = self._ensure_mirror()
        if fresh:
            self.sync()
        return mirror.model

    def save(self, step: int) -> None:
        """Snapshot the training state (between steps) and write checkpoint `step`."""
        self.sync()
        self.manager.save(checkpoint_number=step)
