"""Default job: handwritten digits (UCI optdigits 8x8, 1,797 images, 10 classes), shipped offline.

`digits.csv.gz` is the copy that scikit-learn ships (UCI ML repository, E. Alpaydin & C. Kaynak,
CC BY 4.0): 64 pixel values 0..16 and the label per row. 20 % of the images, chosen by a fixed
shuffle, are held out for evaluation.
"""

from __future__ import annotations

import gzip
from functools import lru_cache
from pathlib import Path

import numpy as np
import tensorflow as tf
import tf_keras

DATA_FILE = Path(__file__).with_name("digits.csv.gz")
HOLDOUT_FRACTION = 0.2


@lru_cache(maxsize=1)
def _split() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    with gzip.open(DATA_FILE, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    features = (table[:, :64] / 16.0).reshape(-1, 8, 8, 1).astype(np.float32)
    labels = table[:, 64].astype(np.int32)
    order = np.random.default_rng(1234).permutation(len(labels))
    n_eval = int(len(labels) * HOLDOUT_FRACTION)
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    return (features[train_idx], labels[train_idx]), (features[eval_idx], labels[eval_idx])


def train_data() -> tuple[np.ndarray, np.ndarray]:
    return _split()[0]


def eval_data() -> tuple[np.ndarray, np.ndarray]:
    return _split()[1]


def model_fn() -> tf_keras.Model:
    """A small CNN: conv 3x3x32 -> conv 3x3x64 -> dense 128 -> 10 logits."""
    return tf_keras.Sequential(
        [
            tf_keras.layers.Input(shape=(8, 8, 1)),
            tf_keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            tf_keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            tf_keras.layers.MaxPooling2D(),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(128, activation="relu"),
            tf_keras.layers.Dense(10),
        ]
    )


def loss_fn(y_true, y_pred):
    """Mean cross-entropy over the batch (a functional loss: Keras loss objects with the default
    reduction refuse to run under a distribution strategy)."""
    return tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True))


def optimizer_fn():
    return tf_keras.optimizers.legacy.Adam(learning_rate=1e-3)
