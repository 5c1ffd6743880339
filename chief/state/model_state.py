"""Building the job's model and optimizer so that every topology starts from the same weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
import tf_keras

from chief.contract.framework import KERAS3, framework_of
from chief.contract.job import Job
from chief.state.initial_values import build_layers, full_rows_initializers, seeded_build
from chief.state.keras3_shards import build_on_shards, refuse_sharded
from chief.state.unfilled import unfilled_initializers

log = logging.getLogger("pstrain.chief")


@dataclass
class ModelState:
    """What a checkpoint holds: the model, its optimizer and the global step."""

    model: tf_keras.Model
    optimizer: tf_keras.optimizers.Optimizer
    global_step: tf.Variable

    def checkpoint(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, global_step=self.global_step)


def initial_weights(job: Job, seed: int, sample) -> list[np.ndarray]:
    """The job's initial weights for `seed` as NumPy arrays: what every topology starts from (a
    reference for tests and tools; training builds its state with `build_state`)."""
    return seeded_build(job.model_fn, seed, sample).get_weights()


def build_state(job: Job, seed: int, sample, ps_init_min_bytes: int | None = None) -> ModelState:
    """Model (initial weights of `seed`), optimizer (with its slots) and global step in the current scope.

    `ps_init_min_bytes` None: built in this process (the standalone run). An int: built under a
    ParameterServerStrategy scope, each variable's initial value being the same as in this process
    whatever the sharding; a variable of at least that many bytes with a tf_keras initializer gets it
    computed on its ps, the others on the chief (chief/state/initial_values.py).
    """
    if ps_init_min_bytes is None:
        model = seeded_build(job.model_fn, seed, sample)
    else:
        with full_rows_initializers(ps_init_min_bytes) as where:
            model = seeded_build(job.model_fn, seed, sample)
        on_ps = sorted(name for name, place in where.items() if place == "ps")
        if on_ps:
            log.info("initial values computed on the ps: %s", ", ".join(on_ps))
    optimizer = job.optimizer_fn()
    refuse_sharded(job.spec, model, optimizer)  # a Keras 3 variable split over ps: what would not be exact
    create_optimizer_slots(optimizer, model.trainable_variables)
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    return ModelState(model=model, optimizer=optimizer, global_step=global_step)


def mirror_state(job: Job, sample) -> ModelState:
    """A local state of the same structure whose values are unspecified (no initializer runs, and no
    memory is used until they are written): the copy the chief fills from the training state or a
    checkpoint (chief/state/checkpoints.py)."""
    with unfilled_initializers():
        model = job.model_fn()
        build_layers(model, sample)
        optimizer = job.optimizer_fn()
        create_optimizer_slots(optimizer, model.trainable_variables)
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    return ModelState(model=model, optimizer=optimizer, global_step=global_step)


def finalize_layers(model: tf_keras.Model) -> None:
    """Let every layer recompute what it derives from its weights, as Keras's `set_weights` and
    `load_weights` do (`Layer.finalize_state`): Normalization keeps its mean and variance as tensors
    read from its variables, which a checkpoint restore or a copy into the variables leaves stale."""
    for layer in model._flatten_layers():
        if hasattr(layer, "finalize_state"):  # Keras 3 layers derive nothing from their weights this way
            layer.finalize_state()


def create_optimizer_slots(optimizer, variables) -> None:
    """Create slot variables now, so a checkpoint restores into them and they live with the variables
    (a Keras 3 optimizer's on the shards of a variable split over ps tasks)."""
    if framework_of(optimizer) == KERAS3:
        build_on_shards(optimizer, list(variables))
    elif hasattr(optimizer, "_create_all_weights"):  # tf_keras.optimizers.legacy.*
        optimizer._create_all_weights(variables)
    elif hasattr(optimizer, "build"):  # tf_keras.optimizers.* (new-style)
        optimizer.build(variables)


def allow_loss_scaling_under_ps() -> None:
    """Let `mixed_float16` and its LossScaleOptimizer be built under ParameterServerStrategy.

    tf_keras refuses them there because its own training loops unscale gradients once per compute
    replica but aggregate per variable replica. pstrain's slots each unscale their own gradient with
    the current loss scale before the aggregator averages them, and the apply (outside any replica
    context) updates the loss scale once per step: the standalone engine does exactly the same.
    """
    from tf_keras.src.mixed_precision import loss_scale_optimizer

    loss_scale_optimizer.strategy_supports_loss_scaling = lambda: True
