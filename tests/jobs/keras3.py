"""Jobs written with Keras 3 (`import keras`), as keras.io's examples write them, for tests/system/test_keras3.py.

`Compiled`: a functional model (an embedding table, BatchNormalization, a kernel constraint and an L2
regularizer) whose loss, optimizer (Adam) and metrics come from `compile()`. `Plain`: an uncompiled
Sequential regression with Dropout and a job-defined Keras 3 loss, optimizer (SGD with momentum and a
schedule) and metrics, trained on sample weights. The refused ones each name what they lack:
`MixedOptimizer` (a Keras 3 model with a tf_keras optimizer), `MixedLoss` (a tf_keras Loss object),
`HalfPrecision` (mixed_float16), `MixedMetrics`, `Accumulating` (gradient accumulation),
`WeightedMeanLoss` (a reduction by the sum of weights).
`Fit` is compiled as keras.io compiles (a loss name), for a step compared with `model.fit`.
"""

from __future__ import annotations

import keras
import numpy as np
import tf_keras

VOCABULARY = 500


def ids_data(n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCABULARY, size=(n, 4)).astype(np.int32)
    extra = rng.normal(size=(n, 3)).astype(np.float32)
    labels = ((ids.sum(axis=1) % 3 + (extra[:, 0] > 0)) % 3).astype(np.int32)
    return {"ids": ids, "extra": extra}, labels


class Compiled:
    @staticmethod
    def model_fn() -> keras.Model:
        ids = keras.Input((4,), dtype="int32", name="ids")
        extra = keras.Input((3,), name="extra")
        x = keras.layers.Flatten()(keras.layers.Embedding(VOCABULARY, 8, name="table")(ids))
        x = keras.layers.Concatenate()([x, extra])
        limited = {"kernel_regularizer": keras.regularizers.L2(1e-3), "kernel_constraint": keras.constraints.MaxNorm(1.0)}
        x = keras.layers.Dense(16, **limited)(x)
        x = keras.layers.BatchNormalization(momentum=0.9)(x)
        x = keras.layers.Activation("relu")(x)
        model = keras.Model({"ids": ids, "extra": extra}, keras.layers.Dense(3)(x))
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    @staticmethod
    def train_data():
        return ids_data(256, 0)

    @staticmethod
    def eval_data():
        return ids_data(64, 1)


def regression_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    y = (x @ np.arange(1, 6, dtype=np.float32) / 5 + 0.1 * rng.normal(size=n)).astype(np.float32)[:, None]
    return x, y, rng.uniform(0.5, 2.0, size=n).astype(np.float32)


class Plain:
    @staticmethod
    def model_fn() -> keras.Model:
        layers = [keras.layers.Dense(8, activation="tanh"), keras.layers.Dropout(0.2), keras.layers.Dense(1)]
        return keras.Sequential([keras.Input((5,)), *layers])

    loss_fn = keras.losses.MeanSquaredError()

    @staticmethod
    def optimizer_fn():
        schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=5, decay_rate=0.5)
        return keras.optimizers.SGD(schedule, momentum=0.9)

    @staticmethod
    def metrics_fn():
        return [keras.metrics.MeanAbsoluteError()]

    @staticmethod
    def train_data():
        return regression_data(256, 0)

    @staticmethod
    def eval_data():
        return regression_data(64, 1)[:2]


class MixedOptimizer(Plain):
    @staticmethod
    def optimizer_fn():
        return tf_keras.optimizers.SGD(0.05)


class MixedLoss(Plain):
    loss_fn = tf_keras.losses.MeanSquaredError()


class HalfPrecision(Plain):
    @staticmethod
    def model_fn() -> keras.Model:
        return keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(8, dtype="mixed_float16", name="half"), keras.layers.Dense(1)]
        )


class Fit(Plain):
    @staticmethod
    def model_fn() -> keras.Model:
        limited = {"kernel_regularizer": keras.regularizers.L2(1e-2), "kernel_constraint": keras.constraints.MaxNorm(0.8)}
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh", **limited), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.5), loss="mse")
        return model

    loss_fn = optimizer_fn = metrics_fn = None


class MixedMetrics(Plain):
    @staticmethod
    def metrics_fn():
        return [tf_keras.metrics.MeanAbsoluteError()]


class Accumulating(Plain):
    @staticmethod
    def optimizer_fn():
        return keras.optimizers.SGD(0.05, gradient_accumulation_steps=2)


class WeightedMeanLoss(Plain):
    loss_fn = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")


class Sharded(Plain):
    """A table larger than a shard (MinSizePartitioner's 256 KiB: 3000 x 48 float32 is 562 KiB), split over
    2 ps, trained by Adam (whose slots Keras 3 makes variable by variable) with a NonNeg kernel."""

    @staticmethod
    def model_fn() -> keras.Model:
        ids = keras.Input((4,), dtype="int32", name="ids")
        x = keras.layers.Flatten()(keras.layers.Embedding(3000, 48, name="big_table")(ids))
        x = keras.layers.Dense(16, activation="relu", kernel_constraint=keras.constraints.NonNeg())(x)
        return keras.Model(ids, keras.layers.Dense(3)(x))

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @staticmethod
    def optimizer_fn():
        return keras.optimizers.Adam(1e-2)

    @staticmethod
    def metrics_fn():
        return ["accuracy"]

    @staticmethod
    def train_data():
        ids, labels = ids_data(256, 0)
        return ids["ids"] * 6, labels  # rows from all over the table (both shards)

    @staticmethod
    def eval_data():
        ids, labels = ids_data(64, 1)
        return ids["ids"] * 6, labels


class ShardedLamb(Sharded):
    @staticmethod
    def optimizer_fn():
        return keras.optimizers.Lamb(1e-2)
