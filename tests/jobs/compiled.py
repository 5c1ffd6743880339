"""Two-output jobs for tests/chief/contract/test_compiled_jobs.py: compiled models, the same with the job's own
per-output losses, and jobs that give a piece in a form pstrain does not take."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tf_keras


def two_output_data(n: int = 256, seed: int = 0):
    """x, {"kind": class 0..2, "size": a number}, per-example weights."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    kind = (np.digitize(x[:, 0] + 0.5 * x[:, 1], [-0.5, 0.5])).astype(np.int32)
    size = (2.0 * x[:, 2] - x[:, 3]).astype(np.float32)
    return x, {"kind": kind, "size": size}, rng.uniform(0.5, 2.0, size=n).astype(np.float32)


def two_output_model() -> tf_keras.Model:
    x = tf_keras.Input((5,), name="x")
    hidden = tf_keras.layers.Dense(8, activation="tanh", kernel_regularizer=tf_keras.regularizers.l2(1e-2))(x)
    return tf_keras.Model(
        x, {"kind": tf_keras.layers.Dense(3, name="kind")(hidden), "size": tf_keras.layers.Dense(1, name="size")(hidden)}
    )


LOSSES = {"kind": tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True), "size": "mse"}
LOSS_WEIGHTS = {"kind": 1.0, "size": 0.3}


class Compiled:
    """compile() gives everything: a loss per output, loss weights, metrics per output, the optimizer."""

    @staticmethod
    def optimizer():
        return tf_keras.optimizers.legacy.SGD(0.1, clipnorm=0.5)

    @classmethod
    def model_fn(cls) -> tf_keras.Model:
        model = two_output_model()
        model.compile(
            optimizer=cls.optimizer(),
            loss=LOSSES,
            loss_weights=LOSS_WEIGHTS,
            metrics={"kind": ["accuracy"], "size": [tf_keras.metrics.MeanAbsoluteError(name="mae")]},
        )
        return model

    @staticmethod
    def train_data():
        return two_output_data()

    @staticmethod
    def eval_data():
        return two_output_data(64, 1)


class CompiledNewStyle(Compiled):
    @staticmethod
    def optimizer():
        return tf_keras.optimizers.Adam(0.05, global_clipnorm=0.5)


class Uncompiled:
    """The job's own loss per output and loss weights (no compile)."""

    model_fn = staticmethod(two_output_model)
    loss_fn = LOSSES
    loss_weights = LOSS_WEIGHTS
    train_data = staticmethod(Compiled.train_data)

    @staticmethod
    def optimizer_fn():
        return tf_keras.optimizers.legacy.SGD(0.1, clipnorm=0.5)


class NoLoss(Compiled):
    @staticmethod
    def model_fn() -> tf_keras.Model:
        model = two_output_model()
        model.compile(optimizer="sgd")
        return model


class BadLossEntry(Uncompiled):
    loss_fn = {"kind": LOSSES["kind"], "size": 3}


class UnknownLossName(Compiled):
    @staticmethod
    def model_fn() -> tf_keras.Model:
        model = two_output_model()
        model.compile(optimizer="sgd", loss={"kind": "sparse_categorical_crossentropy", "size": "msee"})
        return model


class BadLossWeights(Uncompiled):
    loss_weights = {"kind": 1.0, "size": "half"}


class OptimizerObject(Uncompiled):
    optimizer_fn = tf_keras.optimizers.legacy.SGD(0.1)


SHARED = tf_keras.optimizers.legacy.SGD(0.1)


class SharedOptimizer(Uncompiled):
    optimizer_fn = staticmethod(lambda: SHARED)


class WrongOutputName(Uncompiled):
    loss_fn = {"kind": LOSSES["kind"], "sise": "mse"}


class Penalized(tf_keras.Model):
    """A subclassed model with its own train_step (an extra penalty on the outputs), as Keras's guide writes one."""

    def __init__(self):
        super().__init__()
        self.hidden = tf_keras.layers.Dense(8, activation="tanh")
        self.kind, self.size = tf_keras.layers.Dense(3, name="kind"), tf_keras.layers.Dense(1, name="size")

    def call(self, x):
        hidden = self.hidden(x)
        return {"kind": self.kind(hidden), "size": self.size(hidden)}

    def train_step(self, data):
        x, y = data[:2]
        with tf.GradientTape() as tape:
            outputs = self(x, training=True)
            loss = self.compiled_loss(y, outputs) + 0.1 * tf.reduce_mean(tf.square(outputs["size"]))
        self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
        return {"loss": loss}


class PenalizedLoss(Penalized):
    """The same penalty through compute_loss, which Keras's train_step calls."""

    train_step = tf_keras.Model.train_step

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        return super().compute_loss(x, y, y_pred, sample_weight) + 0.1 * tf.reduce_mean(tf.square(y_pred["size"]))


def compiled(model_class: type) -> tf_keras.Model:
    model = model_class()
    model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.1), loss=LOSSES)
    return model


class CustomTrainStep(Compiled):
    model_fn = staticmethod(lambda: compiled(Penalized))


class CustomComputeLoss(Compiled):
    model_fn = staticmethod(lambda: compiled(PenalizedLoss))
