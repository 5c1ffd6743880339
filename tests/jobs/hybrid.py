"""Jobs for the hybrid step (train.dense = "allreduce"): the small recommender with tf_keras's new-style
optimizers, whose dense tower the workers replicate while its tables stay on the ps; and refused forms."""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf
import tf_keras

from chief.jobs.recommender import FEATURES, Recommender
from chief.optimizers import LazyAdam


@dataclass(frozen=True)
class WithOptimizer(Recommender):
    optimizer: str = "adam"
    tower: int = 0  # > 0: two hidden layers of this width (a dense tower of about tower**2 parameters)

    def model_fn(self) -> tf_keras.Model:
        model = super().model_fn()
        if not self.tower:
            return model
        hidden = model.layers[-2].input  # the tables' concatenated outputs (the input of the 64-unit layer)
        for _ in range(2):
            hidden = tf_keras.layers.Dense(self.tower, activation="relu")(hidden)
        return tf_keras.Model(model.inputs, tf_keras.layers.Dense(2)(hidden))

    def optimizer_fn(self):
        if self.optimizer == "momentum":
            return tf_keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
        if self.optimizer == "clipped":
            return tf_keras.optimizers.Adam(learning_rate=0.01, clipnorm=1.0)
        if self.optimizer == "legacy":
            return tf_keras.optimizers.legacy.Adam(learning_rate=0.01)
        if self.optimizer == "legacy-sgd":  # the tables updated row-sparse (the new-style SGD's are dense)
            return tf_keras.optimizers.legacy.SGD(learning_rate=0.05, momentum=0.9)
        if self.optimizer == "lazy-adam":
            return LazyAdam(learning_rate=0.01)
        if self.optimizer == "nadam":
            return tf_keras.optimizers.legacy.Nadam(learning_rate=0.01)
        if self.optimizer == "loss-scaled":
            return tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.legacy.SGD(learning_rate=0.05))
        return tf_keras.optimizers.Adam(learning_rate=0.01)


SIZES = dict(users=20_000, items=2_000, dim=8, examples=4_096, eval_examples=1_024)
adam = WithOptimizer(**SIZES)
momentum = WithOptimizer(**SIZES, optimizer="momentum")
clipped = WithOptimizer(**SIZES, optimizer="clipped")
legacy = WithOptimizer(**SIZES, optimizer="legacy")
legacy_sgd = WithOptimizer(**SIZES, optimizer="legacy-sgd")
loss_scaled = WithOptimizer(**SIZES, optimizer="loss-scaled")
lazy_adam = WithOptimizer(**SIZES, optimizer="lazy-adam")
nadam = WithOptimizer(**SIZES, optimizer="nadam")
tower = WithOptimizer(**SIZES, tower=1024)  # 1.1 M dense parameters: a timing of "ps" against "allreduce"


@dataclass(frozen=True)
class DenseOnly(WithOptimizer):
    """The recommender's examples through dense layers only (ids scaled or one-hot, no table): a hybrid
    step with no row-sparse variable, which leaves the ps off a step's path (worker/replica/loop.py lean_loop)."""

    def model_fn(self) -> tf_keras.Model:
        inputs = {name: tf_keras.Input(shape=(), dtype="int32", name=name) for name in ("user", "item", *FEATURES)}
        sizes = {"user": self.users, "item": self.items}
        scaled = [
            tf_keras.layers.Lambda(lambda t, n=n: tf.cast(t, "float32")[..., None] / n)(inputs[k]) for k, n in sizes.items()
        ]
        hot = [tf_keras.layers.Lambda(lambda t, n=n: tf.one_hot(t, n))(inputs[k]) for k, n in FEATURES.items()]
        hidden = tf_keras.layers.Dense(64, activation="relu")(tf_keras.layers.Concatenate()([*scaled, *hot]))
        return tf_keras.Model(inputs, tf_keras.layers.Dense(2)(hidden))


dense_adam = DenseOnly(**SIZES)
dense_legacy_sgd = DenseOnly(**SIZES, optimizer="legacy-sgd")


@dataclass(frozen=True)
class Scheduled(WithOptimizer):
    """Halves the learning rate from the second epoch, with Keras's own LearningRateScheduler."""

    def callbacks_fn(self):
        return [tf_keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.01 if epoch == 0 else 0.005)]


scheduled = Scheduled(**SIZES)
scheduled_legacy = Scheduled(**SIZES, optimizer="legacy")


@dataclass(frozen=True)
class ScheduledDenseOnly(DenseOnly, Scheduled):
    """The dense-only model with the halving schedule: no ps on a step's path, the rate read once a block."""


scheduled_dense_legacy = ScheduledDenseOnly(**SIZES, optimizer="legacy")


@dataclass(frozen=True)
class Regularized(WithOptimizer):
    """A tower with weight regularizers (L2 kernels, an L1 bias), which Keras computes from the variables
    themselves: the workers' copies must stand in for them there too."""

    def model_fn(self) -> tf_keras.Model:
        model = super().model_fn()
        hidden = model.layers[-2].input
        l2 = tf_keras.regularizers.L2(1e-2)
        hidden = tf_keras.layers.Dense(32, activation="relu", kernel_regularizer=l2, bias_regularizer="l1")(hidden)
        return tf_keras.Model(model.inputs, tf_keras.layers.Dense(2, kernel_regularizer=l2)(hidden))


regularized = Regularized(**SIZES)
regularized_legacy = Regularized(**SIZES, optimizer="legacy")


@dataclass(frozen=True)
class RegularizedDenseOnly(DenseOnly):
    """The dense-only model with an L2 kernel: the lean step (no ps on its path) exchanges the loss too."""

    def model_fn(self) -> tf_keras.Model:
        model = super().model_fn()
        out = tf_keras.layers.Dense(2, kernel_regularizer=tf_keras.regularizers.L2(1e-2))
        return tf_keras.Model(model.inputs, out(model.layers[-2].output))


regularized_dense = RegularizedDenseOnly(**SIZES)


@dataclass(frozen=True)
class HeldLoss(WithOptimizer):
    """A loss that holds a dense variable itself (`add_loss(lambda: ... kernel ...)` on the model): refused
    by "allreduce", which cannot see the read; trained by "ps" as Keras trains it."""

    def model_fn(self) -> tf_keras.Model:
        model = super().model_fn()
        kernel = model.layers[-1].kernel
        model.add_loss(lambda: 1e-3 * tf.reduce_sum(tf.square(kernel)))
        return model


held_loss = HeldLoss(**SIZES)
