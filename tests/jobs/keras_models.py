"""Jobs written the way Keras users write them, for tests/system/test_keras_models.py (tiny data, few steps).

`Mixed` exercises several features in one run (so CI pays for one cluster): a functional model with
a dict of named inputs, a CNN branch with random augmentation, GaussianNoise and BatchNormalization,
Dropout, an L2 regularizer, a Keras `Loss` object, per-example sample weights and metrics_fn. `MixedNoL2` is the same without the
regularizer; `BackupBN` lets a test count BatchNormalization updates exactly; `Bf16` trains a
regression MLP under `mixed_bfloat16` with a per-example Keras loss function, `Fp16` the same under
`mixed_float16` with a LossScaleOptimizer; `AdaptedFromEnv` adapts a Normalization on data an environment
variable shifts.
"""

from __future__ import annotations

import os

import numpy as np
import tf_keras


def mixed_data(n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    image = rng.normal(size=(n, 8, 8, 1)).astype(np.float32)
    extra = rng.normal(size=(n, 4)).astype(np.float32)
    labels = ((image.mean(axis=(1, 2, 3)) * 8 + extra[:, 0]) > 0).astype(np.int32) + 2 * (extra[:, 1] > 0).astype(np.int32)
    weights = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    words = np.array([f"{'hi' if e > 0 else 'lo'} w{r}" for e, r in zip(extra[:, 1], rng.integers(0, 6, n), strict=True)])
    # extra: for a Normalization to adapt to; words: for a TextVectorization to learn its vocabulary from
    return {"image": image, "extra": 3.0 * extra + 5.0, "words": words}, labels, weights


class Mixed:
    L2 = 1e-2
    BATCH_NORM = True

    @classmethod
    def model_fn(cls) -> tf_keras.Model:
        image = tf_keras.Input((8, 8, 1), name="image")
        extra = tf_keras.Input((4,), name="extra")
        words = tf_keras.Input((), dtype="string", name="words")
        x = tf_keras.layers.RandomFlip("horizontal")(image)  # random augmentation and noise: per (step, slot) too
        x = tf_keras.layers.GaussianNoise(0.05)(x)
        x = tf_keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(x)  # no bias before BN (zero gradient)
        if cls.BATCH_NORM:
            x = tf_keras.layers.BatchNormalization(momentum=0.9)(x)
        x = tf_keras.layers.ReLU()(x)
        x = tf_keras.layers.GlobalAveragePooling2D()(x)
        # Adapted to the training data when the model is built. Normalization's mean and variance are
        # tensors the layer derives from its variables, which the chief's copy for evaluation and export
        # must re-derive; TextVectorization's vocabulary is a weight that is no variable.
        features = mixed_data(256, 0)[0]
        norm = tf_keras.layers.Normalization(name="extra_norm")
        norm.adapt(features["extra"])
        # tf-idf: its weights have a shape known only once adapted (a variable of shape [None]).
        vocabulary = tf_keras.layers.TextVectorization(max_tokens=12, output_mode="tf_idf", name="vocabulary")
        vocabulary.adapt(features["words"])
        x = tf_keras.layers.Concatenate()([x, norm(extra), vocabulary(words)])
        x = tf_keras.layers.Dense(16, activation="relu", kernel_regularizer=tf_keras.regularizers.l2(cls.L2))(x)
        x = tf_keras.layers.Dropout(0.3)(x)
        return tf_keras.Model({"image": image, "extra": extra, "words": words}, tf_keras.layers.Dense(4)(x))

    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @staticmethod
    def optimizer_fn():
        return tf_keras.optimizers.legacy.Adam(3e-3)

    @staticmethod
    def train_data():
        return mixed_data(256, 0)

    @staticmethod
    def eval_data():
        return mixed_data(128, 1)

    @staticmethod
    def metrics_fn():
        return [
            tf_keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
            tf_keras.metrics.SparseTopKCategoricalAccuracy(2, name="top2"),
        ]


class MixedNoL2(Mixed):
    L2 = 0.0


class MixedNoBN(Mixed):
    """`Mixed` without its BatchNormalization (forward-pass state, which train.dense = "allreduce" refuses)."""

    BATCH_NORM = False


def backup_data(n: int = 192) -> tuple[np.ndarray, np.ndarray]:
    """Column 0 is always 1: its batch variance is 0 in every slot, so after k moving-average updates
    BatchNormalization's moving variance of that column is exactly momentum ** k."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    x[:, 0] = 1.0
    return x, (x[:, 1:2] * 2.0).astype(np.float32)


class BackupBN:
    MOMENTUM = 0.9

    @classmethod
    def model_fn(cls) -> tf_keras.Model:
        return tf_keras.Sequential(
            [tf_keras.Input((4,)), tf_keras.layers.BatchNormalization(momentum=cls.MOMENTUM), tf_keras.layers.Dense(1)]
        )

    loss_fn = staticmethod(tf_keras.losses.mean_squared_error)  # one loss per example

    @staticmethod
    def optimizer_fn():
        return tf_keras.optimizers.legacy.SGD(0.05)

    train_data = staticmethod(backup_data)


def regression_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    return x, (np.sin(x[:, :1]) + 0.5 * x[:, 1:2]).astype(np.float32)


class Bf16:
    """mixed_bfloat16: bfloat16 compute, float32 variables (and so float32 gradients and aggregation)."""

    @staticmethod
    def model_fn() -> tf_keras.Model:
        tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")
        return tf_keras.Sequential(
            [
                tf_keras.Input((6,)),
                tf_keras.layers.Dense(32, activation="relu"),
                tf_keras.layers.Dense(1, dtype="float32"),  # the output in float32, as Keras advises
            ]
        )

    loss_fn = staticmethod(tf_keras.losses.mean_squared_error)

    @staticmethod
    def optimizer_fn():
        return tf_keras.optimizers.legacy.Adam(1e-2)

    @staticmethod
    def train_data():
        return regression_data(256, 0)

    @staticmethod
    def eval_data():
        return regression_data(64, 1)


class Fp16(Bf16):
    """mixed_float16 with its loss-scale optimizer (dynamic loss scale)."""

    @staticmethod
    def model_fn() -> tf_keras.Model:
        tf_keras.mixed_precision.set_global_policy("mixed_float16")
        return tf_keras.Sequential(
            [
                tf_keras.Input((6,)),
                tf_keras.layers.Dense(32, activation="relu"),
                tf_keras.layers.Dense(1, dtype="float32"),
            ]
        )

    @staticmethod
    def optimizer_fn():
        return tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.legacy.Adam(1e-2))


class AdaptedFromEnv:
    """A regression MLP whose Normalization model_fn adapts on data shifted by $PSTRAIN_TEST_ADAPT_SHIFT:
    a resume whose adapt differs is refused (chief/state/adapted.py)."""

    @staticmethod
    def model_fn() -> tf_keras.Model:
        norm = tf_keras.layers.Normalization()
        norm.adapt(regression_data(64, 0)[0] + float(os.environ.get("PSTRAIN_TEST_ADAPT_SHIFT", "0")))
        layers = [tf_keras.Input((6,)), norm, tf_keras.layers.Dense(8, activation="relu"), tf_keras.layers.Dense(1)]
        return tf_keras.Sequential(layers)

    loss_fn = "mse"

    @staticmethod
    def optimizer_fn():
        return tf_keras.optimizers.legacy.SGD(0.05)

    @staticmethod
    def train_data():
        return regression_data(128, 0)
