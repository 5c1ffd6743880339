"""Benchmark jobs: MLPs of about 1 M, 10 M and 50 M parameters on synthetic data.

What is measured is the cost of computing and moving parameters and gradients, so the data are
random and the model is a plain MLP: 784 -> H -> H -> 10. pstrain's examples are drawn as the peers
draw theirs, made on its workers, none repeated in a run (tests/benchmarks/drawn.py); the --data
section's jobs (DataSmall, ...) read a fixed set from where each says.
"""

from __future__ import annotations

import os
from functools import lru_cache, partial
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from tests.benchmarks.drawn import DRAWN, drawn, one_example

if TYPE_CHECKING:
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
    import tf_keras  # not at import: the TF1 peer imports this module and never uses Keras

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
    import tf_keras

    return tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True))


def optimizer():
    import tf_keras

    return tf_keras.optimizers.legacy.SGD(learning_rate=0.01)


def fresh_batch(seed, n: int, size: str = ""):
    """n examples from a [2] seed, made where it runs (tests/benchmarks/fair.py's peers)."""
    sx, sy = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    return tf.random.stateless_normal([n, INPUTS], sx), tf.random.stateless_uniform([n], sy, 0, CLASSES, tf.int32)


example = partial(one_example, fresh_batch)  # (seed, size): one example drawn as fresh_batch draws each of its n (pstrain's)


class _Mlp:
    size = ""
    loss_fn = staticmethod(loss)
    optimizer_fn = staticmethod(optimizer)
    train_dataset = staticmethod(lambda: drawn(fresh_batch))
    bench_data = DRAWN

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


# --- where the data lives (bench.py --data): the 1 M MLP fed four ways ------------------------------
# $PSTRAIN_BENCH_DATA holds x.npy / y.npy (the large set) and files/NNNNNNN.bin (one example per file),
# written by bench.py before any timing.


def _bench_dir() -> str:
    return os.environ["PSTRAIN_BENCH_DATA"]


class _Fixed(Mlp1M):
    """A fixed set of examples, read from where each subclass says."""

    train_dataset = None
    bench_data = "the job's arrays shuffled and batched on the workers"


class DataSmall(_Fixed):
    """(a) small arrays from train_data(): 4,096 examples, 12 MiB."""

    train_data = staticmethod(_data)


class DataArrays(_Fixed):
    """(b) the large set as train_data() arrays in the chief's memory."""

    train_data = staticmethod(lambda: (np.load(f"{_bench_dir()}/x.npy"), np.load(f"{_bench_dir()}/y.npy")))


class DataNpy(_Fixed):
    """(c) the same large set as .npy files each worker reads (train_arrays(), the fast path)."""

    train_arrays = staticmethod(lambda: (f"{_bench_dir()}/x.npy", f"{_bench_dir()}/y.npy"))


class DataFiles(_Fixed):
    """(d) one file per example (train_dataset()): 784 raw float32 values per file; label = index mod 10."""

    @staticmethod
    def train_dataset():
        folder = f"{_bench_dir()}/files"
        count = int(open(f"{folder}/count").read())

        def read(i):
            name = tf.strings.join([folder, "/", tf.strings.as_string(i, width=7, fill="0"), ".bin"])
            x = tf.ensure_shape(tf.io.decode_raw(tf.io.read_file(name), tf.float32), [INPUTS])
            return x, tf.cast(i % CLASSES, tf.int32)

        return tf.data.Dataset.range(count).map(read)


DATA_JOBS = {
    "a small arrays": "tests.benchmarks.jobs:DataSmall",
    "b large arrays (train_data)": "tests.benchmarks.jobs:DataArrays",
    "c large .npy on the workers (train_arrays)": "tests.benchmarks.jobs:DataNpy",
    "d one file per example (train_dataset)": "tests.benchmarks.jobs:DataFiles",
}


def write_bench_data(directory: str, gigabytes: float, files: int) -> None:
    """x.npy/y.npy of `gigabytes` and `files` example files, unless already there with those sizes."""
    from pathlib import Path

    from worker.input.tables import write_npy

    root = Path(directory)
    (root / "files").mkdir(parents=True, exist_ok=True)
    rows = int(gigabytes * 1e9 / (4 * INPUTS))
    x_path = root / "x.npy"
    if not x_path.exists() or np.load(x_path, mmap_mode="r").shape[0] != rows:
        x = np.lib.format.open_memmap(root / "x.tmp.npy", mode="w+", dtype=np.float32, shape=(rows, INPUTS))
        rng = np.random.default_rng(0)
        for start in range(0, rows, 65536):
            x[start : start + 65536] = rng.standard_normal((min(65536, rows - start), INPUTS), dtype=np.float32)
        x.flush()
        del x
        os.replace(root / "x.tmp.npy", x_path)
        write_npy(root / "y.npy", (np.arange(rows) % CLASSES).astype(np.int32))
    count = root / "files" / "count"
    if not count.exists() or int(count.read_text()) != files:
        rng = np.random.default_rng(1)
        for i in range(files):
            (root / "files" / f"{i:07d}.bin").write_bytes(rng.standard_normal(INPUTS, dtype=np.float32).tobytes())
        count.write_text(str(files))
