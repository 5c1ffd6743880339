"""Test jobs for data that lives on the workers (worker/input/sources.py).

- `digits_npy`: the digits as the job's own .npy files (the fast path, `train_arrays()`), written at
  first use under $PSTRAIN_DATA_DIR; trains to the same model as `chief.jobs.digits`.
- `relative_npy`: `data/x.npy`, `data/y.npy` relative to each process's working directory (each
  machine its own copy), for the tests where one machine's copy differs or is missing.
- `one_file_per_example`: $PSTRAIN_TEST_FILES/NNNNNN.bin, one raw float32 vector per file (made by
  `write_example_files`), a linear regression on it: memory must not grow with the number of files.
- `big_arrays`: `train_data()` of $PSTRAIN_BIG_GB gigabytes (default 2.2) for a tiny linear model.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import tensorflow as tf
import tf_keras

from chief.jobs import digits
from worker.input.tables import write_npy


class digits_npy:  # noqa: N801  (a job object: --job tests.jobs.data_jobs:digits_npy)
    model_fn = staticmethod(digits.model_fn)
    loss_fn = staticmethod(digits.loss_fn)
    optimizer_fn = staticmethod(digits.optimizer_fn)
    eval_data = staticmethod(digits.eval_data)

    @staticmethod
    def train_arrays():
        directory = Path(os.environ["PSTRAIN_DATA_DIR"]) / "digits-npy"
        directory.mkdir(parents=True, exist_ok=True)
        features, labels = digits.train_data()
        for name, array in (("x.npy", features), ("y.npy", labels)):
            if not (directory / name).exists():
                write_npy(directory / name, array)
        return str(directory / "x.npy"), str(directory / "y.npy")


def linear_model(inputs: int) -> tf_keras.Model:
    return tf_keras.Sequential([tf_keras.layers.Input(shape=(inputs,)), tf_keras.layers.Dense(1)])


def mse(y_true, y_pred):
    return tf.reduce_mean(tf.square(tf.reshape(y_pred, [-1]) - tf.cast(y_true, tf.float32)))


def sgd():
    return tf_keras.optimizers.legacy.SGD(learning_rate=0.01)


def write_relative_npy(directory: Path, seed: int, rows: int = 256, inputs: int = 8) -> None:
    """`directory`/data/{x,y}.npy: a small regression set (a different seed = different content)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, inputs), dtype=np.float32)
    (directory / "data").mkdir(parents=True, exist_ok=True)
    write_npy(directory / "data" / "x.npy", x)
    write_npy(directory / "data" / "y.npy", x.sum(axis=1))


class relative_npy:  # noqa: N801
    model_fn = staticmethod(lambda: linear_model(8))
    loss_fn = staticmethod(mse)
    optimizer_fn = staticmethod(sgd)
    train_arrays = staticmethod(lambda: ("data/x.npy", "data/y.npy"))


FILE_INPUTS = 16384  # 64 KiB per example


def write_example_files(directory: Path, count: int, seed: int = 0) -> None:
    """`count` files of FILE_INPUTS raw float32 values each."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        (directory / f"{i:06d}.bin").write_bytes(rng.standard_normal(FILE_INPUTS, dtype=np.float32).tobytes())


class one_file_per_example:  # noqa: N801
    model_fn = staticmethod(lambda: linear_model(FILE_INPUTS))
    loss_fn = staticmethod(mse)
    optimizer_fn = staticmethod(lambda: tf_keras.optimizers.legacy.SGD(learning_rate=1e-4))

    @staticmethod
    def train_dataset():
        folder = os.environ["PSTRAIN_TEST_FILES"]
        count = len([p for p in os.listdir(folder) if p.endswith(".bin")])  # on the chief, at trace time

        def read(i):
            name = tf.strings.join([folder, "/", tf.strings.as_string(i, width=6, fill="0"), ".bin"])
            x = tf.ensure_shape(tf.io.decode_raw(tf.io.read_file(name), tf.float32), [FILE_INPUTS])
            return x, tf.reduce_mean(x[:64])  # target: a function of the example

        return tf.data.Dataset.range(count).map(read)


class big_arrays:  # noqa: N801
    INPUTS = 256
    model_fn = staticmethod(lambda: linear_model(big_arrays.INPUTS))
    loss_fn = staticmethod(mse)
    optimizer_fn = staticmethod(sgd)
    eval_data = staticmethod(lambda: (np.ones((8, big_arrays.INPUTS), np.float32), np.zeros(8, np.float32)))

    @staticmethod
    def train_data():
        gigabytes = float(os.environ.get("PSTRAIN_BIG_GB", "2.2"))
        rows = int(gigabytes * 1e9 / (4 * big_arrays.INPUTS))
        x = np.empty((rows, big_arrays.INPUTS), np.float32)
        x[:] = np.arange(big_arrays.INPUTS, dtype=np.float32) / big_arrays.INPUTS  # cheap to fill, not compressible away
        x[:, 0] = np.arange(rows, dtype=np.float32) / rows
        return x, x[:, 0].copy()


class lookup_layers:  # noqa: N801
    """Text and id features through every Keras preprocessing layer with a table or a hash:
    StringLookup, TextVectorization (given vocabularies), IntegerLookup and Hashing."""

    COLORS = ["red", "green", "blue", "cyan"]

    @staticmethod
    def model_fn():
        color = tf_keras.Input((2,), dtype=tf.string, name="color")
        words = tf_keras.Input((1,), dtype=tf.string, name="words")
        size = tf_keras.Input((1,), dtype=tf.int64, name="size")
        parts = [
            tf_keras.layers.StringLookup(vocabulary=lookup_layers.COLORS, output_mode="multi_hot")(color),
            tf_keras.layers.TextVectorization(vocabulary=["a", "b", "c"], output_mode="multi_hot")(words),
            tf_keras.layers.IntegerLookup(vocabulary=[1, 2, 3], output_mode="one_hot")(size),
            tf_keras.layers.Hashing(8, output_mode="one_hot")(words),
        ]
        x = tf_keras.layers.Concatenate()([tf.cast(p, tf.float32) for p in parts])
        return tf_keras.Model({"color": color, "words": words, "size": size}, tf_keras.layers.Dense(1)(x))

    loss_fn = staticmethod(tf_keras.losses.mean_squared_error)
    optimizer_fn = staticmethod(lambda: tf_keras.optimizers.legacy.SGD(0.05))

    @staticmethod
    def train_data():
        rng = np.random.default_rng(0)
        color = np.array([*lookup_layers.COLORS, "pink"])[rng.integers(0, 5, (128, 2))]  # "pink": out of vocabulary
        words = np.array(["a b", "c", "b c zz", "q"], dtype=object)[rng.integers(0, 4, (128, 1))]
        size = rng.integers(0, 4, (128, 1))
        target = (color[:, 0] == "red") + size[:, 0] + np.char.count(words[:, 0].astype(str), "b")
        return {"color": color, "words": words, "size": size}, target.astype(np.float32)


class digits_records_filtered:  # noqa: N801
    """chief.jobs.digits_records without the 9s (a filter: the epoch's size is unknown until it ends)."""

    model_fn = staticmethod(digits.model_fn)
    loss_fn = staticmethod(digits.loss_fn)
    optimizer_fn = staticmethod(digits.optimizer_fn)
    eval_data = staticmethod(digits.eval_data)

    @staticmethod
    def train_dataset():
        from chief.jobs import digits_records

        return digits_records.train_dataset().filter(lambda image, label: label != 9)


class filtered_regression:  # noqa: N801
    """A linear regression on a filtered range: 77 examples, a stream of unknown size (9 batches of 8)."""

    model_fn = staticmethod(lambda: linear_model(4))
    loss_fn = staticmethod(mse)
    optimizer_fn = staticmethod(lambda: tf_keras.optimizers.legacy.SGD(learning_rate=0.05))

    @staticmethod
    def train_dataset():
        def example(i):
            x = tf.sin(tf.cast(tf.range(4), tf.float32) + tf.cast(i, tf.float32))
            return x, tf.reduce_sum(x) * 0.5

        return tf.data.Dataset.range(90).filter(lambda i: i % 7 != 0).map(example)


class branching_stream(filtered_regression):  # noqa: N801
    """filtered_regression whose map function branches on a tensor in Python, as users write them:
    AutoGraph makes the `if` a tf.cond (also where a worker makes a fresh pipeline inside a closure)."""

    @staticmethod
    def train_dataset():
        def example(i):
            x = tf.sin(tf.cast(tf.range(4), tf.float32) + tf.cast(i, tf.float32))
            if i % 2 == 0:
                x = -x
            return x, tf.reduce_sum(x) * 0.5

        return tf.data.Dataset.range(90).filter(lambda i: i % 7 != 0).map(example)
