"""Building the job's model and optimizer so that every topology starts from the same weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf
import tf_keras

from chief.jobs import Job
from chief.sharding import assign_weights


@dataclass
class ModelState:
    """What a checkpoint holds: the model, its optimizer and the global step."""

    model: tf_keras.Model
    optimizer: tf_keras.optimizers.Optimizer
    global_step: tf.Variable

    def checkpoint(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, global_step=self.global_step)


def initial_weights(job: Job, seed: int, sample: np.ndarray) -> list[np.ndarray]:
    """The job's initial weights for `seed`, built locally: identical whatever the topology."""
    tf_keras.utils.set_random_seed(seed)
    model = job.model_fn()
    model(sample, training=False)
    return model.get_weights()


def build_state(job: Job, weights: list[np.ndarray], sample: np.ndarray) -> ModelState:
    """Model, optimizer (with its slots) and global step in the current (strategy) scope."""
    model = job.model_fn()
    model(sample, training=False)
    assign_weights(model.weights, weights)
    optimizer = job.optimizer_fn()
    create_optimizer_slots(optimizer, model.trainable_variables)
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    return ModelState(model=model, optimizer=optimizer, global_step=global_step)


def create_optimizer_slots(optimizer, variables) -> None:
    """Create slot variables now, so a checkpoint restores into them and they live with the variables."""
    if hasattr(optimizer, "_create_all_weights"):  # tf_keras.optimizers.legacy.*
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
