"""Jobs whose output carries a Keras mask (`Embedding(mask_zero=True)` before per-timestep outputs),
for tests/chief/contract/test_masked_loss.py: `Masked` (a tf_keras mean loss, compiled), `MaskedSum`
(the same with reduction SUM), `MaskedWeighted` (a mean loss with per-example sample weights), and
their Keras 3 twins `Keras3Masked`, `Keras3MaskedSum`."""

from __future__ import annotations

import keras
import numpy as np
import tf_keras

VOCABULARY, STEPS = 50, 6


def padded_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences of 1 to STEPS ids padded with 0 (the mask), and a class per timestep."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCABULARY, size=(n, STEPS)).astype(np.int32)
    lengths = rng.integers(1, STEPS + 1, size=n)
    ids[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
    return ids, (ids % 3).astype(np.int32)


def masked_model(reduction: str = tf_keras.losses.Reduction.AUTO) -> tf_keras.Model:
    ids = tf_keras.Input((STEPS,), dtype="int32")
    x = tf_keras.layers.Embedding(VOCABULARY, 8, mask_zero=True)(ids)
    model = tf_keras.Model(ids, tf_keras.layers.Dense(3)(tf_keras.layers.Dense(8, activation="tanh")(x)))
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    model.compile(optimizer=tf_keras.optimizers.SGD(0.5), loss=loss, metrics=["accuracy"])
    return model


class Masked:
    @staticmethod
    def model_fn() -> tf_keras.Model:
        return masked_model()

    @staticmethod
    def train_data():
        return padded_data(64, 0)

    @staticmethod
    def eval_data():
        return padded_data(32, 1)


class MaskedSum(Masked):
    @staticmethod
    def model_fn() -> tf_keras.Model:
        return masked_model(tf_keras.losses.Reduction.SUM)


class MaskedWeighted(Masked):
    @staticmethod
    def train_data():
        ids, labels = padded_data(64, 0)
        return ids, labels, np.random.default_rng(2).uniform(0.5, 2.0, size=64).astype(np.float32)


def keras3_masked_model(reduction: str = "sum_over_batch_size") -> keras.Model:
    ids = keras.Input((STEPS,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, 8, mask_zero=True)(ids)
    model = keras.Model(ids, keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(x)))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss, metrics=["accuracy"])
    return model


class Keras3Masked(Masked):
    @staticmethod
    def model_fn() -> keras.Model:
        return keras3_masked_model()


class Keras3MaskedSum(Masked):
    @staticmethod
    def model_fn() -> keras.Model:
        return keras3_masked_model("sum")
