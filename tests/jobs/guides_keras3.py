"""Jobs written from Keras's own guides with `import keras` (Keras 3), for the guide-pattern matrix
(tests/system/test_guide_patterns.py, KERAS3_CASES). Tiny data, tiny models: each case trains a few steps.

- `BuiltInMethods`: keras.io's "Training & evaluation with the built-in methods" guide as its Keras 3
  page writes it: a functional model compiled with `keras.optimizers.RMSprop`,
  SparseCategoricalCrossentropy and SparseCategoricalAccuracy, its ActivityRegularizationLayer
  (`self.add_loss` in `call()`), a Dense with `activity_regularizer`, sample weights.
- `LookupInDataset`: keras.io's "Working with preprocessing layers" pattern of a `keras.layers.StringLookup`
  applied in the training dataset's `map`, created in `train_dataset()`, its ids into an `Embedding`; Adam,
  binary cross-entropy, `metrics=["accuracy"]` on a one-unit sigmoid. (Keras 3's one-hot lookup of one
  string gives shape (1, N), not tf_keras's (N,): examples one at a time would gain an axis.)
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tests.jobs.guides import FEATURES, digits_like


class ActivityRegularizationLayer(keras.layers.Layer):
    """The built-in methods guide's layer: a loss added in call()."""

    def call(self, inputs):
        self.add_loss(keras.ops.sum(inputs) * 0.1)
        return inputs


class BuiltInMethods:
    @staticmethod
    def model_fn():
        inputs = keras.Input(shape=(6,), name="digits")
        x = keras.layers.Dense(16, activation="relu", name="dense_1")(inputs)
        x = ActivityRegularizationLayer()(x)
        x = keras.layers.Dense(16, activation="relu", activity_regularizer=keras.regularizers.L2(1e-2), name="dense_2")(x)
        outputs = keras.layers.Dense(3, activation="softmax", name="predictions")(x)
        model = keras.Model(inputs=inputs, outputs=outputs)
        model.compile(
            optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
        return model

    @staticmethod
    def train_data():
        return digits_like(256, 0)

    @staticmethod
    def eval_data():
        return digits_like(96, 1)[:2]


def heroes(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` (hero name, liked) pairs: the label follows the name's position in FEATURES, with noise."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(FEATURES), n)
    names = np.array(FEATURES, dtype=object)[picks].astype(str)
    liked = ((picks % 2 == 0) ^ (rng.uniform(size=n) < 0.1)).astype(np.float32)
    return names, liked


class LookupInDataset:
    @staticmethod
    def model_fn():
        ids = keras.Input(shape=(), dtype="int64", name="hero")
        x = keras.layers.Embedding(len(FEATURES) + 1, 4)(ids)  # index 0: the lookup's out-of-vocabulary id
        x = keras.layers.Dense(8, activation="relu")(x)
        model = keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(x))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=["accuracy"])
        return model

    @staticmethod
    def _mapped(names: np.ndarray, liked: np.ndarray) -> tf.data.Dataset:
        lookup = keras.layers.StringLookup(vocabulary=FEATURES)  # one id per name (one-hot would add an axis)
        return tf.data.Dataset.from_tensor_slices((names, liked)).map(lambda name, label: (lookup(name), label))

    @staticmethod
    def train_dataset():
        return LookupInDataset._mapped(*heroes(256, 0))

    @staticmethod
    def eval_dataset():
        return LookupInDataset._mapped(*heroes(96, 1))
