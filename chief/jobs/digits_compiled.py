"""A compiled two-output job on the shipped digits data: the template for `model.compile` jobs.

The model reads an 8x8 digit and predicts its class (`digit`, 10 logits) and how much ink it has
(`ink`, the mean pixel value, a regression). Loss, loss weights, metrics and optimizer (with
gradient clipping) come from `compile()`: the job defines no loss_fn, optimizer_fn or metrics_fn.
Its 512 KiB dense kernel is split across ps tasks with `--ps 2`; the clipping is still per whole
variable, so the run equals the standalone one.
"""

from __future__ import annotations

import numpy as np
import tf_keras

from chief.jobs import digits


def with_ink(data: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    images, labels = data
    return images, {"digit": labels, "ink": images.mean(axis=(1, 2, 3)).astype(np.float32)}


def train_data() -> tuple[np.ndarray, dict[str, np.ndarray]]:
    return with_ink(digits.train_data())


def eval_data() -> tuple[np.ndarray, dict[str, np.ndarray]]:
    return with_ink(digits.eval_data())


def model_fn() -> tf_keras.Model:
    image = tf_keras.Input((8, 8, 1), name="image")
    x = tf_keras.layers.Conv2D(32, 3, padding="same", activation="relu")(image)
    x = tf_keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = tf_keras.layers.Flatten()(tf_keras.layers.MaxPooling2D()(x))
    x = tf_keras.layers.Dense(128, activation="relu")(x)  # a 1024 x 128 kernel (512 KiB)
    outputs = {"digit": tf_keras.layers.Dense(10, name="digit")(x), "ink": tf_keras.layers.Dense(1, name="ink")(x)}
    model = tf_keras.Model(image, outputs)
    model.compile(
        optimizer=tf_keras.optimizers.Adam(1e-3, global_clipnorm=1.0),
        loss={"digit": tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True), "ink": "mse"},
        loss_weights={"digit": 1.0, "ink": 10.0},
        metrics={"digit": ["accuracy"], "ink": ["mae"]},
    )
    return model
