"""Training by epochs (`train.epochs`, Keras's `fit(epochs=N)`): how many steps an epoch is.

pstrain's steps are always whole global batches, and its data order walks on through the shuffled
training set without a break (chief/step/positions.py, worker/input/streams.py). An epoch is therefore
Keras's count with `drop_remainder=True`:

    steps per epoch = examples in one pass // examples read per step

where a step reads `total_num_replicas` slot batches (the global batch, plus the backups' slots). The
remainder (fewer examples than a step) opens the next epoch's first step, so every epoch is the same
number of steps and epoch e is steps [e * S, (e + 1) * S). The plan is decided once, before the first
step, from the data's length (arrays, files, a dataset's cardinality, or a stream's recorded or declared
length), identically by the standalone and the cluster engine; a resume continues at its step, so a
resume mid-epoch continues that epoch exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cluster.config import EPOCH, TrainConfig
from cluster.errors import ConfigError


@dataclass(frozen=True)
class Epochs:
    epochs: int
    steps_per_epoch: int

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def epoch_of(self, step: int) -> int:
        """The epoch (0-based, as Keras's callbacks count) that step index `step` (0-based) belongs to."""
        return step // self.steps_per_epoch

    def ends_epoch(self, done: int) -> bool:
        """Whether `done` applied steps is an epoch's end."""
        return done > 0 and done % self.steps_per_epoch == 0

    def resolve(self, train: TrainConfig) -> TrainConfig:
        """`train` in steps: `steps` the epochs' total, "epoch" intervals the epoch's length."""
        every = {name: self.steps_per_epoch for name in ("eval_every", "checkpoint_every") if getattr(train, name) == EPOCH}
        return replace(train, steps=self.steps, **every)


def epochs_for(train: TrainConfig, pass_examples: int | None, unknown_why: str = "") -> Epochs | None:
    """The plan for `train` (None when it trains by steps) given the examples in one pass over the
    training set (None: not known before the first pass, `unknown_why` says why). Pure."""
    if not train.epochs:
        return None
    if pass_examples is None:
        raise ConfigError(
            f"train.epochs: the length of the training data is not known before its first pass ({unknown_why}); "
            "declare it in train_dataset() with .apply(tf.data.experimental.assert_cardinality(N)), "
            "or train by --steps (a first run records a stream's length in RUN_DIR/stream.json, which a resume by epochs reads)"
        )
    per_step = train.slot_batch_size * train.total_num_replicas
    if pass_examples < per_step:
        raise ConfigError(
            f"train.epochs: one pass over the training data is {pass_examples} examples, fewer than one step reads "
            f"({per_step}); use a smaller --global-batch-size or more data"
        )
    return Epochs(train.epochs, pass_examples // per_step)


def pass_length(source) -> tuple[int | None, str]:
    """(examples in one pass over `source`, or None and why it is not known). A stream's pass is its
    whole slot batches (the last partial one is dropped): from RUN_DIR/stream.json once a run learnt
    it, else from the pipeline's declared finite cardinality."""
    if not getattr(source, "streams", False):
        return source.num_examples, ""
    if source.batches_per_epoch:
        return source.batches_per_epoch * source.slot_batch, ""
    from worker.input.datasets import DatasetSource

    cardinality = int(DatasetSource.made(source.make, source.what).cardinality().numpy())
    if cardinality > 0:
        return cardinality // source.slot_batch * source.slot_batch, ""
    kind = "repeats without end" if cardinality == -1 else "is a stream of unknown cardinality (filter, interleave, TFRecord)"
    return None, f"train_dataset() {kind}"
