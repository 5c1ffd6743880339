"""Benchmark jobs: MLPs of about 1 M, 10 M and 50 M parameters on synthetic data.

What is measured is the cost of computing and moving parameters and gradients, so the data are
random (fixed seed) and the model is a plain MLP: 784 -> H -> H -> 10.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import tensorflow as tf
import tf_keras

INPUTS, CLASSES, EXAMPLES = 784, 10, 4096
HIDDEN = {"1m": 700, "10m": 2800, "50m": 6700}


def parameters(size: str) -> int:
    h = HIDDEN[size]
    return INPUTS * h + h + h * h + h + h * CLASSES + CLASSES


@lru_cache(maxsize=1)
def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((EXAMPLES, INPUTS), dtype=np.float32), rng.integers(0, CLASSES, EXAMPLES).astype(np.int32)


def build_model(size: str) -> tf_keras.Model:
    h = HIDDEN[size]
    return tf_keras.Sequential(
        [
            tf_keras.layers.Input(shape=(INPUTS,)),
            tf_keras.layers.Dense(h, activation="relu"),
            tf_keras.layers.Dense(h, activation="relu"),
            tf_keras.layers.Dense(CLASSES),
        ]
    )


def loss(y_true, y_pred):
    return tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True))


def optimizer():
    return tf_keras.optimizers.legacy.SGD(learning_rate=0.01)


class _Mlp:
    size = ""
    loss_fn = staticmethod(loss)
    optimizer_fn = staticmethod(optimizer)
    train_data = staticmethod(_data)

    @classmethod
    def model_fn(cls):
        return build_model(cls.size)


class Mlp1M(_Mlp):
    size = "1m"


class Mlp10M(_Mlp):
    size = "10m"


class Mlp50M(_Mlp):
    size = "50m"


JOBS = {"1m": "tests.benchmarks.jobs:Mlp1M", "10m": "tests.benchmarks.jobs:Mlp10M", "50m": "tests.benchmarks.jobs:Mlp50M"}
