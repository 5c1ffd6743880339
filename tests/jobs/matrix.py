"""The job matrix (tests/chief/test_job_matrix.py): one tiny job in every data form, with and without sample
weights, with one output or two, compiled or not, named `--job tests.jobs.matrix:<form>_<w|u>_<1|2>_<c|p>`
(w: weighted, u: unweighted; 1/2 outputs; c: compiled, p: plain job attributes).

Every form carries the same examples: a float column `x` [3] and a text column `word`, which a
StringLookup maps to ids (so each form also carries text), labels `kind` (class 0..2) and, with two
outputs, `size` (a number), and per-example weights. Forms:

- `arrays`: `train_data()` of NumPy arrays (text as a `U` array);
- `objects`: `train_data()` with the text as an object array of `str` (written as fixed-width text);
- `npy`: `train_arrays()`, paths of `.npy` files written under $PSTRAIN_MATRIX_DIR;
- `position`: `train_dataset()` from `from_tensor_slices`, read by position;
- `stream`: the same with a `filter`, read as a stream;
- `tfrecord`: `train_dataset()` parsing TFRecord files under $PSTRAIN_MATRIX_DIR, a stream.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import tensorflow as tf
import tf_keras

from worker.input.tables import write_npy

ROWS = 96
WORDS = ["red", "green", "blue", "cyan"]
FORMS = ("arrays", "objects", "npy", "position", "stream", "tfrecord")


def examples(rows: int = ROWS, seed: int = 0) -> tuple[dict, dict, np.ndarray]:
    """({"x", "word"}, {"kind", "size"}, weights) as NumPy arrays."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype(np.float32)
    word = np.array(WORDS)[rng.integers(0, len(WORDS), rows)]
    kind = np.digitize(x[:, 0] + 0.5 * (word == "red"), [-0.5, 0.5]).astype(np.int32)
    size = (2.0 * x[:, 1] - x[:, 2]).astype(np.float32)
    return {"x": x, "word": word}, {"kind": kind, "size": size}, rng.uniform(0.2, 3.0, rows).astype(np.float32)


def model(outputs: int) -> tf_keras.Model:
    x = tf_keras.Input((3,), name="x")
    word = tf_keras.Input((), dtype=tf.string, name="word")
    ids = tf_keras.layers.StringLookup(vocabulary=WORDS)(word)
    hidden = tf_keras.layers.Concatenate()([x, tf_keras.layers.Embedding(len(WORDS) + 1, 2)(ids)])
    hidden = tf_keras.layers.Dense(6, activation="tanh")(hidden)
    kind = tf_keras.layers.Dense(3, name="kind")(hidden)
    heads = {"kind": kind, "size": tf_keras.layers.Dense(1, name="size")(hidden)} if outputs == 2 else kind
    return tf_keras.Model({"x": x, "word": word}, heads)


LOSSES = {"kind": tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True), "size": "mse"}


def optimizer():
    return tf_keras.optimizers.legacy.SGD(0.1, momentum=0.5)


def data_dir() -> Path:
    directory = Path(os.environ.get("PSTRAIN_MATRIX_DIR", Path.home() / ".cache" / "pstrain" / "matrix"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _labels(labels: dict, outputs: int):
    return labels if outputs == 2 else labels["kind"]


def _npy_paths(weighted: bool, outputs: int) -> tuple:
    directory = data_dir() / "npy"
    features, labels, weights = examples()
    arrays = {"x": features["x"], "word": features["word"], **labels, "weights": weights}
    if not (directory / "weights.npy").exists():
        directory.mkdir(parents=True, exist_ok=True)
        for name, array in arrays.items():
            write_npy(directory / f"{name}.npy", array)
    path = {name: str(directory / f"{name}.npy") for name in arrays}
    paths = ({"x": path["x"], "word": path["word"]}, _labels({"kind": path["kind"], "size": path["size"]}, outputs))
    return (*paths, path["weights"]) if weighted else paths


def _tfrecord_files() -> list[str]:
    directory = data_dir() / "tfrecord"
    files = [str(directory / f"part-{i}.tfrecord") for i in range(2)]
    if not Path(files[-1]).exists():
        directory.mkdir(parents=True, exist_ok=True)
        features, labels, weights = examples()
        for i, name in enumerate(files):
            with tf.io.TFRecordWriter(name + ".tmp") as writer:
                for r in range(i, ROWS, 2):
                    feature = {
                        "x": tf.train.Feature(float_list=tf.train.FloatList(value=features["x"][r])),
                        "word": tf.train.Feature(bytes_list=tf.train.BytesList(value=[features["word"][r].encode()])),
                        "kind": tf.train.Feature(int64_list=tf.train.Int64List(value=[labels["kind"][r]])),
                        "size": tf.train.Feature(float_list=tf.train.FloatList(value=[labels["size"][r]])),
                        "weight": tf.train.Feature(float_list=tf.train.FloatList(value=[weights[r]])),
                    }
                    writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
            os.replace(name + ".tmp", name)
    return files


def _tfrecord_dataset(weighted: bool, outputs: int) -> tf.data.Dataset:
    spec = {
        "x": tf.io.FixedLenFeature([3], tf.float32),
        "word": tf.io.FixedLenFeature([], tf.string),
        "kind": tf.io.FixedLenFeature([], tf.int64),
        "size": tf.io.FixedLenFeature([], tf.float32),
        "weight": tf.io.FixedLenFeature([], tf.float32),
    }

    def parse(record):
        e = tf.io.parse_single_example(record, spec)
        labels = _labels({"kind": tf.cast(e["kind"], tf.int32), "size": e["size"]}, outputs)
        element = ({"x": e["x"], "word": e["word"]}, labels)
        return (*element, e["weight"]) if weighted else element

    files = tf.data.Dataset.from_tensor_slices(_tfrecord_files())
    return files.interleave(tf.data.TFRecordDataset, cycle_length=2).map(parse)


def job(form: str, weighted: bool, outputs: int, compiled: bool) -> type:
    """A job object for one case of the matrix."""

    def data():
        features, labels, weights = examples()
        if form == "objects":
            features = {**features, "word": features["word"].astype(object)}
        element = (features, _labels(labels, outputs))
        return (*element, weights) if weighted else element

    def model_fn():
        built = model(outputs)
        if compiled:
            built.compile(optimizer=optimizer(), loss=LOSSES if outputs == 2 else LOSSES["kind"], loss_weights=None)
        return built

    attributes: dict = {"model_fn": staticmethod(model_fn)}
    if not compiled:
        attributes |= {"loss_fn": LOSSES if outputs == 2 else LOSSES["kind"], "optimizer_fn": staticmethod(optimizer)}
    if form in ("arrays", "objects"):
        attributes["train_data"] = staticmethod(data)
    elif form == "npy":
        attributes["train_arrays"] = staticmethod(lambda: _npy_paths(weighted, outputs))
    elif form in ("position", "stream"):
        sliced = lambda: tf.data.Dataset.from_tensor_slices(data())  # noqa: E731
        kept = lambda: sliced().filter(lambda *element: tf.constant(True))  # noqa: E731
        attributes["train_dataset"] = staticmethod(sliced if form == "position" else kept)
    elif form == "tfrecord":
        attributes["train_dataset"] = staticmethod(lambda: _tfrecord_dataset(weighted, outputs))
    else:
        raise AttributeError(form)
    return type(case_name(form, weighted, outputs, compiled), (), attributes)


def case_name(form: str, weighted: bool, outputs: int, compiled: bool) -> str:
    return f"{form}_{'w' if weighted else 'u'}_{outputs}_{'c' if compiled else 'p'}"


def __getattr__(name: str) -> type:
    """`tests.jobs.matrix:<form>_<w|u>_<1|2>_<c|p>` as a job object (for `pstrain --job`)."""
    try:
        form, weighted, outputs, compiled = name.rsplit("_", 3)
        if form not in FORMS or weighted not in "wu" or outputs not in "12" or compiled not in "cp":
            raise ValueError(name)
    except ValueError:
        raise AttributeError(name) from None
    return job(form, weighted == "w", int(outputs), compiled == "c")


class two_weights_per_example:  # noqa: N801  (refused by both engines in the same line)
    """Sample weights of shape [2] per example for a loss of one value per example."""

    model_fn = staticmethod(lambda: model(1))
    loss_fn = LOSSES["kind"]
    optimizer_fn = staticmethod(optimizer)

    @staticmethod
    def train_dataset():
        features, labels, weights = examples()
        return tf.data.Dataset.from_tensor_slices((features, labels["kind"], np.stack([weights, weights], 1)))


class class_weighted(job("stream", True, 1, False)):  # noqa: N801
    """The weighted stream job with fit's class_weight: each example's weight times its class's."""

    class_weight = {0: 0.5, 1: 2.0, 2: 1.25}


class class_weighted_two_outputs(job("arrays", False, 2, True)):  # noqa: N801
    """class_weight on a model with two outputs: refused, as fit refuses it."""

    class_weight = {0: 0.5, 1: 2.0, 2: 1.25}
