"""Checkpoints written by the chief from a full local copy of the state: for a cluster whose ps cannot
all write to the checkpoint directory (no shared mount), and only for a model that fits the chief.

The mirror is made unfilled (no initializer runs; memory is taken as values are written), and values
move between it and the ps in row chunks (chief/state/sharding.py `copy_rows`), so the chief never
holds a second full-size value beside it. Evaluation and export then read the mirror's model.
"""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf
import tf_keras

from chief.contract.job import Job
from chief.state.checkpoints import Checkpoints, checkpointed_variables, say
from chief.state.model_state import ModelState, finalize_layers, mirror_state
from chief.state.sharding import copy_rows, shard_groups


class MirrorCheckpoints(Checkpoints):
    """Save and restore the cluster's state through one full-size local copy on the chief."""

    def __init__(self, live: ModelState, job: Job, sample, directory: Path, say=say):
        super().__init__(live, directory, say)
        self.job, self.sample = job, sample
        self._mirror: ModelState | None = None
        self.pairs: list[tuple[list[tf.Variable], tf.Variable]] = []  # (shards of a live variable, its mirror)

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
        self._checkpoint = mirror.checkpoint()
        self._checkpoint.save_counter  # noqa: B018 (created now, as the direct route's is)
        return mirror, True

    def prepare(self) -> None:
        self._ensure_mirror()  # every value is local: the save runs no function on the ps

    def _restore(self, prefix: Path) -> None:
        mirror, _ = self._ensure_mirror()
        self._checkpoint.restore(str(prefix)).assert_existing_objects_matched()
        for shards, full in self.pairs:
            copy_rows([full], shards)
        # The mirror's layers recompute what they derive from their weights. The live model's came from
        # the same model_fn on the same data (a Normalization's adapt), so they hold already.
        finalize_layers(mirror.model)

    def _write(self, prefix: Path) -> None:
        self.sync()
        self._checkpoint.write(str(prefix))

    def sync(self) -> None:
        """Copy the training state (between steps) into the local mirror."""
        mirror, _ = self._ensure_mirror()
        for shards, full in self.pairs:
            copy_rows(shards, [full])
        finalize_layers(mirror.model)

    def model(self) -> tf_keras.Model:
        mirror, fresh = self._ensure_mirror()
        if fresh:
            self.sync()
        return mirror.model
