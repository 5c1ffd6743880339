"""Jobs with one embedding table and plain SGD (no optimizer slots), for the chief's memory tests:
`large` 4,000,000 x 64 float32 (977 MiB, more than the chief's memory limit in its test), `big`
2,000,000 x 64 (488 MiB), `tiny` 1,000 x 64. All read ids below 1,000, so they differ only in the
table's size."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf
import tf_keras

DIM, TOKENS = 64, 4


@dataclass(frozen=True)
class Table:
    rows: int

    @property
    def table_bytes(self) -> int:
        return self.rows * DIM * 4

    def model_fn(self) -> tf_keras.Model:
        return tf_keras.Sequential(
            [
                tf_keras.Input(shape=(TOKENS,), dtype="int32"),
                tf_keras.layers.Embedding(self.rows, DIM),
                tf_keras.layers.GlobalAveragePooling1D(),
                tf_keras.layers.Dense(2),
            ]
        )

    def loss_fn(self, y_true, y_pred):
        return tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True))

    def optimizer_fn(self):
        return tf_keras.optimizers.legacy.SGD(0.1)

    def train_data(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(0)
        return rng.integers(0, 1000, (512, TOKENS)).astype(np.int32), rng.integers(0, 2, 512).astype(np.int32)


large = Table(4_000_000)
big = Table(2_000_000)
tiny = Table(1_000)
