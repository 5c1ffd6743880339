"""Checkpoints written from a local mirror of the training state.

Saving a ParameterServerStrategy model directly traces a new tf.function for every save, and
registering it contacts every worker: one stalled worker would then block the save that a stop
needs. Instead the chief reads the variables from the ps (plain eager reads, only the ps involved)
into a local copy of the same model and optimizer, and saves that. Checkpoints are therefore the
same format for cluster and standalone runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

from chief.jobs import Job
from chief.model_state import ModelState, mirror_state
from chief.sharding import assign_full, read_full, shard_groups


def state_variables(state: ModelState) -> list[tf.Variable]:
    """Everything a checkpoint holds, in an order both copies share."""
    optimizer = state.optimizer.variables
    return [*state.model.weights, *(optimizer() if callable(optimizer) else optimizer), state.global_step]


class Checkpoints:
    def __init__(self, live: ModelState, job: Job, sample, directory: Path, local: bool):
        self.live = live
        self.mirror = live if local else mirror_state(job, sample)  # zeros until the first sync or restore
        live_vars, mirror_vars = state_variables(live), state_variables(self.mirror)
        try:  # a variable sharded across ps tasks is one full-size variable in the mirror
            groups = shard_groups([v.shape for v in live_vars], [v.shape for v in mirror_vars])
        except ValueError as e:
            raise RuntimeError(f"the local checkpoint mirror does not match the training state: {e}") from None
        self.pairs = [([live_vars[i] for i in group], mirror) for group, mirror in zip(groups, mirror_vars, strict=True)]
        self.manager = tf.train.CheckpointManager(self.mirror.checkpoint(), str(directory), max_to_keep=3)

    @property
    def latest(self) -> str | None:
        return self.manager.latest_checkpoint

    def restore_latest(self) -> int:
        """Load the latest checkpoint into the training state; returns its global step (0 if none)."""
        if self.latest:
            self.mirror.checkpoint().restore(self.latest).assert_existing_objects_matched()
            if self.mirror is not self.live:
                for shards, mirror in self.pairs:
                    assign_full(shards, mirror.read_value())
        return int(self.live.global_step.numpy())

    def weights(self) -> list[np.ndarray]:
        """The model's full-size weights as of the last save or restore."""
        return self.mirror.model.get_weights()

    def sync(self) -> None:
        """Copy the training state (between steps) into the local mirror; `weights()` then returns it."""
        if self.mirror is not self.live:
            for shards, mirror in self.pairs:
                mirror.assign(read_full(shards))

    def save(self, step: int) -> None:
        """Snapshot the training state (between steps) and write checkpoint `step`."""
        self.sync()
        self.manager.save(checkpoint_number=step)
