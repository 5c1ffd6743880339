"""The digits as text: the template for string features through a Keras lookup layer.

Each 8x8 image becomes 8 words, one per pixel row, each pixel a character by its ink ("." blank,
"+" grey, "#" dark): a digit is a sentence like "..##.... .#..#... ...". `train_data()` returns them
as a NumPy string array; pstrain writes it as a fixed-width `.npy` file that the workers memory-map
and decode in-graph (docs/data.md). The model maps each word to an id with a
`StringLookup` of a given vocabulary (every row word seen at least twice in the training images;
others are out-of-vocabulary), embeds it and classifies; each worker gets its own copy of the lookup
table, and the exported SavedModel takes the strings: `serve(rows=tf.constant([[b"..##....", ...]]))`.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import numpy as np
import tensorflow as tf
import tf_keras

from chief.jobs import digits
from chief.jobs.digits import loss_fn, optimizer_fn  # noqa: F401  (the same loss and optimizer)

INK = np.array(list(".+#"))


def as_words(features: np.ndarray) -> np.ndarray:
    """[n, 8, 8, 1] pixels in 0..1 -> [n, 8] row words of 8 characters."""
    levels = np.minimum((features[..., 0] * len(INK)).astype(int), len(INK) - 1)
    return np.array(["".join(row) for row in INK[levels].reshape(-1, 8)]).reshape(len(features), 8)


@lru_cache(maxsize=1)
def vocabulary() -> list[str]:
    """Row words seen at least twice in the training images, most frequent first (ties by the word)."""
    counts = Counter(as_words(digits.train_data()[0]).ravel().tolist())
    return sorted((word for word, n in counts.items() if n >= 2), key=lambda w: (-counts[w], w))


def train_data() -> tuple[dict, np.ndarray]:
    features, labels = digits.train_data()
    return {"rows": as_words(features)}, labels


def eval_data() -> tuple[dict, np.ndarray]:
    features, labels = digits.eval_data()
    return {"rows": as_words(features)}, labels


def model_fn() -> tf_keras.Model:
    rows = tf_keras.Input((8,), dtype=tf.string, name="rows")
    ids = tf_keras.layers.StringLookup(vocabulary=vocabulary())(rows)  # 0: out of vocabulary
    x = tf_keras.layers.Embedding(len(vocabulary()) + 1, 16)(ids)
    x = tf_keras.layers.Flatten()(x)
    x = tf_keras.layers.Dense(128, activation="relu")(x)
    return tf_keras.Model({"rows": rows}, tf_keras.layers.Dense(10)(x))
