"""Where a job's examples live, and how the examples of one (step, slot) are read where they are used.

A source is built on each worker by TensorFlow ops (the chief only traces `dataset_fn`), so no data
passes through the chief or sits in a graph as a constant. Two kinds:

- `TableSource`: arrays in `.npy` files (the job's own, or those pstrain writes from `train_data()`)
  read once into the worker's memory; a closure gathers its rows (a gather, as fast as an in-memory
  array).
- `DatasetSource`: the job's `tf.data.Dataset` of single examples (element i = example i), read by
  position with `tf.data.experimental.at` in a parallel map, so memory does not grow with the set.

Both engines read through the same code: the standalone process reads the same positions locally.
Each worker's source carries a fingerprint (cardinality + a digest of sampled examples) that every
closure compares with the chief's before it computes, so different data on one worker is refused.
"""

from __future__ import annotations

import contextlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from chief.data.readahead import ReadAhead
from chief.job import JobError, as_written, checked_arrays

Nest = Any
SAMPLES = 16  # examples digested per fingerprint: first, last and evenly spaced between
MISMATCH_TAG = "pstrain-data-mismatch"
# Examples read at once by a closure. A fixed number, not AUTOTUNE: each closure's read is a fresh,
# one-batch pipeline that autotuning never warms up for (128 one-file reads: 7.2 ms with AUTOTUNE,
# 3.2 ms with 64, in one process on this machine).
READ_PARALLELISM = 64


class DataError(JobError):
    """Data that is missing or differs on a worker; the message names the worker, its host and what."""


@dataclass(frozen=True)
class Fingerprint:
    cardinality: int
    digest: int  # farmhash of the serialized sampled examples, as int64


def sample_positions(num_examples: int, samples: int = SAMPLES) -> np.ndarray:
    """The positions a fingerprint digests: spread over the whole set, first and last included."""
    return np.unique(np.linspace(0, num_examples - 1, min(samples, num_examples)).round().astype(np.int64))


def digest(batch: Nest) -> tf.Tensor:
    """An int64 digest of a nest of tensors (TF ops: runs alike on the chief and on a worker)."""
    serialized = tf.stack([tf.io.serialize_tensor(leaf) for leaf in tf.nest.flatten(batch)])
    rows = tf.fingerprint(serialized)  # [leaves, 8] uint8
    return tf.bitcast(tf.reshape(tf.fingerprint(tf.reshape(rows, [1, -1])), [8]), tf.int64)


def check_fingerprint(cardinality: tf.Tensor, found: tf.Tensor, expected: Fingerprint) -> tf.Operation:
    """In a closure: stop with a tagged error (see `explain_worker_error`) if the worker's data differs."""
    worker = tf.distribute.coordinator.experimental_get_current_worker_index()
    same = tf.logical_and(tf.equal(cardinality, expected.cardinality), tf.equal(found, expected.digest))
    return tf.debugging.Assert(
        same,
        [MISMATCH_TAG, "worker", worker, "cardinality", cardinality, expected.cardinality, "digest", found, expected.digest],
    )


class Source(ABC):
    """Examples 0..num_examples-1, readable by position on a worker and in this process."""

    num_examples: int

    @abstractmethod
    def read_local(self, indices: np.ndarray) -> Nest:
        """The examples at `indices` as a nest of tensors with a leading batch axis, read in this process."""

    @abstractmethod
    def _build(self) -> tuple[tf.Tensor, Nest]:
        """TF ops run on the worker (inside a dataset map): (cardinality, handle to read from)."""

    @abstractmethod
    def _read(self, handle: Nest, indices: tf.Tensor) -> Nest:
        """TF ops: the examples at `indices` from what `_build` made."""

    def first(self, n: int) -> Nest:
        """The first (up to) `n` examples, read in this process."""
        return self.read_local(np.arange(min(self.num_examples, n)))

    def fingerprint(self) -> Fingerprint:
        """The chief's expectation, from its own view of the data (touches only the sampled examples)."""
        batch = self.read_local(sample_positions(self.num_examples))
        return Fingerprint(self.num_examples, int(digest(batch).numpy()))

    streams = False  # read by position (a stream: chief/data/streams.py)
    reads_ahead = False  # whether `dataset_fn` uses a ReadAhead (a gather from memory needs none: it is ignored)

    def dataset_fn(self, readahead: ReadAhead | None = None) -> tf.data.Dataset:
        """Per-worker dataset: one element ((cardinality, digest), handle), repeated.

        The source is built lazily by the first closure's `next()` (and then cached), so a failure
        such as a missing file surfaces in that closure with the worker's name, not as a hang.
        """
        positions = tf.constant(sample_positions(self.num_examples))

        def build(_):
            cardinality, handle = self._build()
            safe = tf.minimum(positions, tf.maximum(cardinality - 1, 0))  # a shorter set must not fail the gather
            return (cardinality, digest(self._read(handle, safe))), handle

        return tf.data.Dataset.range(1).map(build).cache().repeat()

    def worker_batch(
        self, element: Nest, indices: tf.Tensor, expected: Fingerprint, tag: tf.Tensor | None = None
    ) -> tuple[Nest, tf.Tensor]:
        """In the closure: check the worker's fingerprint against the chief's, then the slot's examples.

        `element` is the per-worker dataset's; with read-ahead (`tag` given, see chief/data/readahead.py)
        the batch read ahead is used when it is this closure's. Returns (batch, whether it was).
        """
        (cardinality, found), handle = element[0], element[1]
        check = check_fingerprint(cardinality, found, expected)
        with tf.control_dependencies([check]):  # no example reaches the model before the check passed
            if tag is None:
                return self._read(handle, tf.identity(indices)), tf.constant(False)
            batch, hit = ReadAhead.take(element[2], tag, lambda: self._read(handle, indices))
            return tf.nest.map_structure(tf.identity, batch), hit


# --- arrays in .npy files -------------------------------------------------------------------------


# Each of the 256 byte values as a one-byte string: how fixed-width `S` rows become tf.string in-graph.
_BYTES = [bytes([b]) for b in range(256)]


@dataclass(frozen=True)
class NpyFile:
    """Where one array lies in a `.npy` file, as read from its header on the chief.

    Text is a fixed-width NumPy string array: `U` (UTF-32 code points, 4 bytes each) or `S` (bytes),
    each string padded with NULs to the width. The worker memory-maps it like numbers (its code
    points or bytes as int32/uint8, one more axis of the width), gathers rows and only then decodes
    them to tf.string (`strings`): UTF-8 for `U`, the bytes themselves for `S`, trailing NULs dropped
    as NumPy drops them.
    """

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # bytes of header before the data

    @classmethod
    def read_header(cls, path: str, what: str) -> NpyFile:
        try:
            with open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read(f)
                offset = f.tell()
        except FileNotFoundError:
            raise JobError(f"{what}: {path} not found on the chief; every process reads the .npy files at this path") from None
        except ValueError as e:
            raise JobError(f"{what}: {path} is not a .npy file ({e})") from None
        if dtype.hasobject:
            raise JobError(
                f"{what}: {path} holds Python objects, which a worker cannot read; save text as fixed-width strings "
                "(np.save(path, a.astype(str)), or a.astype(bytes))"
            )
        if fortran or not shape or offset % 64:
            raise JobError(
                f"{what}: {path} must hold a C-ordered array with a leading example axis "
                "(save it with np.save(path, np.ascontiguousarray(a)))"
            )
        return cls(str(path), dtype, tuple(shape), offset)

    @property
    def text(self) -> bool:
        return self.dtype.kind in "US"

    @property
    def codes(self) -> tuple[np.dtype, tuple[int, ...]]:
        """(dtype, shape) of the array as the worker holds it: text as code points or bytes, one axis more."""
        if self.dtype.kind == "U":
            return np.dtype(self.dtype.byteorder.replace("|", "=") + "i4"), (*self.shape, self.dtype.itemsize // 4)
        if self.dtype.kind == "S":
            return np.dtype(np.uint8), (*self.shape, self.dtype.itemsize)
        return self.dtype, self.shape

    def load(self) -> tf.Tensor:
        """TF ops: the whole array (text as its codes), memory-mapped from the file where it can be
        (native byte order, not bool): no read of the whole file up front; otherwise decoded from the
        file's bytes."""
        dtype, shape = self.codes
        if dtype == np.bool_ or not dtype.isnative:
            return self._decode()
        itemsize, count = dtype.itemsize, int(np.prod(shape))

        def int64(*values: int) -> tf.Tensor:  # sizes past 2**31 bytes
            return tf.constant(values, tf.int64)

        raw = tf.raw_ops.ImmutableConst(dtype=tf.uint8, shape=[self.offset + count * itemsize], memory_region_name=self.path)
        data = tf.slice(raw, int64(self.offset), int64(count * itemsize))  # the header is 64-byte aligned: a view, no copy
        values = tf.bitcast(tf.reshape(data, int64(count, itemsize)) if itemsize > 1 else data, tf.as_dtype(dtype))
        return tf.reshape(values, int64(*shape))

    def _decode(self) -> tf.Tensor:
        dtype, shape = self.codes
        bool_ = dtype == np.bool_
        raw_dtype = tf.uint8 if bool_ else tf.as_dtype(dtype.newbyteorder("="))
        values = tf.io.decode_raw(tf.io.read_file(self.path), raw_dtype, little_endian=dtype.byteorder != ">")
        values = tf.reshape(values[self.offset // dtype.itemsize :], [-1, *shape[1:]])
        return tf.cast(values, tf.bool) if bool_ else values

    def strings(self, rows: tf.Tensor) -> tf.Tensor:
        """TF ops: gathered rows of `load()` as the array's values (text decoded to tf.string)."""
        if not self.text:
            return rows
        width = self.codes[1][-1]
        flat = tf.reshape(rows, [-1, width])
        if self.dtype.kind == "U":
            text = tf.strings.unicode_encode(tf.RaggedTensor.from_tensor(flat, padding=0), "UTF-8")
        else:
            codes = tf.RaggedTensor.from_tensor(tf.cast(flat, tf.int32), padding=0)
            text = tf.strings.reduce_join(tf.gather(tf.constant(_BYTES), codes), axis=-1)
        return tf.reshape(text, tf.shape(rows)[:-1])


def write_npy(path: Path, array: np.ndarray) -> None:
    """Write an array atomically (tmp + rename), C-ordered."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(array))
    tmp.replace(path)


class TableSource(Source):
    """Arrays read once into each worker's memory from `.npy` files; closures gather their rows."""

    def __init__(self, files: Nest, arrays: Nest):
        self.files = files  # nest of NpyFile, read by the workers
        self.arrays = arrays  # the same nest as arrays in this process (in memory or memory-mapped)
        lengths = {f.shape[0] for f in tf.nest.flatten(files)}
        if len(lengths) != 1:
            raise JobError(f"the arrays hold different numbers of examples ({sorted(lengths)}); they must match")
        self.num_examples = lengths.pop()

    @classmethod
    def from_arrays(cls, data: Nest, directory: Path) -> TableSource:
        """`train_data()` arrays: written once to `directory` (the run dir) for the workers to read."""
        directory.mkdir(parents=True, exist_ok=True)
        leaves = tf.nest.flatten(data)  # text already fixed-width (checked_arrays)
        files = []
        for i, leaf in enumerate(leaves):
            path = directory.resolve() / f"train-{i}.npy"
            write_npy(path, leaf)
            files.append(NpyFile.read_header(str(path), "train_data()"))
        return cls(tf.nest.pack_sequence_as(data, files), data)

    @classmethod
    def from_npy_paths(cls, paths: Nest, what: str) -> TableSource:
        """`train_arrays()`: the job's own .npy files, at the same path on every machine."""
        files = tf.nest.map_structure(lambda p: NpyFile.read_header(str(p), what), paths)
        arrays = tf.nest.map_structure(lambda f: np.load(f.path, mmap_mode="r"), files)
        return cls(files, arrays)

    def read_local(self, indices: np.ndarray) -> Nest:
        return tf.nest.map_structure(lambda a: tf.constant(np.asarray(a[np.asarray(indices)])), self.arrays)

    def _build(self):
        tables = tf.nest.map_structure(NpyFile.load, self.files)
        return tf.cast(tf.shape(tf.nest.flatten(tables)[0])[0], tf.int64), tables

    def _read(self, handle, indices):
        return tf.nest.map_structure(lambda f, t: f.strings(tf.gather(t, indices)), self.files, handle)


# --- a tf.data.Dataset of single examples -----------------------------------------------------------


def read_positions(dataset: tf.data.Dataset, indices: tf.Tensor) -> Nest:
    """TF ops: elements `indices` of a random-access dataset, read in parallel, in order, as one batch
    (of a static size when `indices` has one: what a slot's loss reshapes its sample weights to)."""
    n = indices.shape[0]
    reads = tf.data.Dataset.from_tensor_slices(indices).map(
        lambda i: tf.data.experimental.at(dataset, i), num_parallel_calls=READ_PARALLELISM, deterministic=True
    )
    if n is not None:  # exactly n elements: one full batch, with its size in the static shape
        return reads.batch(n, drop_remainder=True).get_single_element()
    return reads.batch(tf.size(indices, out_type=tf.int64)).get_single_element()


_SHAPES = re.compile(r"First element had shape (\[[^\]]*\]) and element (\d+) had shape (\[[^\]]*\])")


@contextlib.contextmanager
def one_shape(what: str) -> Iterator[None]:
    """Within the block, batching examples of different shapes raises a JobError naming them: a job whose
    pipeline batches (each example then a batch, the last one shorter) or yields ragged examples."""
    try:
        yield
    except tf.errors.InvalidArgumentError as e:
        found = _SHAPES.search(e.message or "")
        if not found:
            raise
        first, _, other = found.groups()
        raise JobError(
            f"{what}: its examples differ in shape (one {first}, another {other}); give single examples of "
            "one shape, which pstrain batches (a .batch() in the pipeline makes each example a batch)"
        ) from None


def pipeline(dataset: tf.data.Dataset) -> list[tf.data.Dataset]:
    """`dataset` and every dataset it is made from."""
    found, todo = [], [dataset]
    while todo:
        found.append(todo.pop())
        todo.extend(found[-1]._inputs())
    return found


def draws_at_random(dataset: tf.data.Dataset) -> bool:
    """Whether `dataset` maps with a function that holds a stateful random op (`tf.random.uniform`)."""
    from chief.graph_ops import STATEFUL_RANDOM_OPS, unsupported_ops

    function = getattr(getattr(dataset, "_map_func", None), "function", None)
    return function is not None and any(op in STATEFUL_RANDOM_OPS for op, _ in unsupported_ops(function.graph))


class DatasetSource(Source):
    """The job's `train_dataset()`: built on each worker from that worker's files, read by position."""

    def __init__(self, make: Callable[[], tf.data.Dataset], what: str):
        self.make, self.what = make, what
        self._local: tuple[str, tf.data.Dataset] | None = None
        cardinality = int(self.local().cardinality().numpy())
        if cardinality == 0:
            raise JobError(f"{what}: the dataset is empty; give at least one slot batch of examples")
        self.num_examples = cardinality
        with one_shape(what):
            self.fingerprint()

    @staticmethod
    def random_access(dataset: tf.data.Dataset) -> bool:
        """Whether `dataset` can be read by position: a known finite size, no shuffle, and `at` works on
        it (reads example 0; a pipeline with TFRecordDataset, interleave, filter ... is read as a stream).
        `at` works on a shuffle, but each read starts a new iterator, whose order a reshuffle changes:
        a shuffled pipeline is read as a stream, made afresh (the same order, with a seed) each epoch.
        So is one whose map draws with stateful random ops: each read would draw anew (and `at` on it
        was seen to crash the process)."""
        if int(dataset.cardinality().numpy()) <= 0:
            return False
        if any("Shuffle" in type(d).__name__ or draws_at_random(d) for d in pipeline(dataset)):
            return False
        try:
            tf.data.experimental.at(dataset, 0)
        except (tf.errors.UnimplementedError, tf.errors.FailedPreconditionError):  # the op names the step that is not
            return False
        return True

    @staticmethod
    def made(make: Callable[[], tf.data.Dataset], what: str) -> tf.data.Dataset:
        """`make()`, checked to be a dataset. Made as the job wrote it (`as_written`): a worker
        may make it inside a closure that pstrain traces with AutoGraph off, and a map function's Python
        `if` on a tensor needs AutoGraph on where `map` is called."""
        dataset = as_written(make)()
        if not isinstance(dataset, tf.data.Dataset):
            raise JobError(f"{what} must return a tf.data.Dataset of single examples, got {type(dataset).__name__}")
        return dataset

    def local(self) -> tf.data.Dataset:
        """The dataset in this process, made again once the process has joined a cluster (its devices change)."""
        space = context.context().host_address_space()
        if self._local is None or self._local[0] != space:
            self._local = (space, self.made(self.make, self.what))
        return self._local[1]

    def read_local(self, indices: np.ndarray) -> Nest:
        return read_positions(self.local(), tf.constant(np.asarray(indices, np.int64)))

    def _build(self):
        dataset = self.make()
        return dataset.cardinality(), dataset

    def _read(self, handle, indices):
        return read_positions(handle, indices)

    reads_ahead = True  # each read opens files: worth doing while the previous step computes

    def dataset_fn(self, readahead: ReadAhead | None = None) -> tf.data.Dataset:
        """Per-worker dataset: ((cardinality, digest), the dataset[, (tag, batch) read ahead]) elements."""
        # The dataset itself cannot pass through a map's output, so it rides beside the cached fingerprint.
        dataset = self.make()
        positions = tf.constant(sample_positions(self.num_examples))

        def fingerprint(_):
            cardinality = dataset.cardinality()
            safe = tf.minimum(positions, tf.maximum(cardinality - 1, 0))
            return cardinality, digest(read_positions(dataset, safe))

        checks = tf.data.Dataset.range(1).map(fingerprint).cache().repeat()
        parts = (checks, tf.data.Dataset.from_tensors(dataset).repeat())
        if readahead is not None:
            parts += (readahead.dataset(lambda positions: read_positions(dataset, positions)),)
        return tf.data.Dataset.zip(parts)


# --- the job's choice, and errors from workers ------------------------------------------------------


def train_source(job, run_dir: Path, train=None):
    """The job's training data as a source: train_dataset() (by position, or as a stream:
    chief/data/streams.py), train_arrays() or train_data(). `train` (TrainConfig) sets a stream's slot
    batch and slots; without it (the evaluator sidecar) a stream can only give its first examples."""
    if job.train_dataset:
        what = f"--job {job.spec}: train_dataset()"
        probe = DatasetSource.made(job.train_dataset, what)
        if probe.cardinality().numpy() == 0 or DatasetSource.random_access(probe):
            return DatasetSource(job.train_dataset, what)
        from chief.data.streams import StreamSource

        slots = (train.slot_batch_size, train.total_num_replicas) if train else (0, 0)
        return StreamSource(job.train_dataset, what, run_dir if train else None, *slots)
    if job.train_arrays:
        return TableSource.from_npy_paths(job.train_arrays(), f"--job {job.spec}: train_arrays()")
    return TableSource.from_arrays(checked_arrays(job.spec, "train_data", job.train_data()), run_dir / "data")


_TASK = re.compile(r"/job:worker/replica:\d+/task:(\d+)")
_MISSING = re.compile(r"([^\s:;]+); No such file or directory")
_MISMATCH = re.compile(
    MISMATCH_TAG + r"\] \[worker\] \[(\d+)\] \[cardinality\] \[(-?\d+)\] \[(-?\d+)\] \[digest\] \[(-?\d+)\] \[(-?\d+)\]"
)


def explain_worker_error(error: tf.errors.OpError, workers: list[str]) -> DataError | None:
    """One line for a data error raised in a closure (a missing file, a fingerprint mismatch), else None."""
    message = error.message or ""
    if match := _MISMATCH.search(message):
        worker, card, want_card, found, want = (int(g) for g in match.groups())
        same = f"the same {card} examples but different content" if card >= 0 else "different first examples"
        what = (
            f"{card} examples, the chief expects {want_card}"
            if card != want_card
            else f"{same} (digest {found:#x}, the chief's {want:#x})"
        )
        return DataError(
            f"worker {worker} ({_host(workers, worker)}): its training data differs from the chief's: {what}; "
            "give every machine the same files"
        )
    if isinstance(error, tf.errors.NotFoundError) and (missing := _MISSING.search(message)):
        task = _TASK.search(message)
        where = f"worker {task.group(1)} ({_host(workers, int(task.group(1)))})" if task else "this process (the chief)"
        return DataError(
            f"{where}: data file {missing.group(1)} not found; every machine reads the job's files from its own disk "
            "(copy them there or use a shared mount)"
        )
    return None


def _host(workers: list[str], index: int) -> str:
    return workers[index] if 0 <= index < len(workers) else "unknown host"
