"""`DatasetSource`: the job's `tf.data.Dataset` of single examples (element i = example i), read by
position (worker/input/position_reads.py), so memory does not grow with the set; and
the checks that decide whether a pipeline can be read so (else it is a stream: worker/input/streams.py)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from chief.contract.as_written import as_written
from chief.contract.job import JobError
from worker.input.lookups import tables_made_here
from worker.input.position_reads import read_positions
from worker.input.readahead import ReadAhead
from worker.input.sources import Nest, Source, digest, sample_positions

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
    from chief.contract.graph_ops import STATEFUL_RANDOM_OPS, unsupported_ops

    function = getattr(getattr(dataset, "_map_func", None), "function", None)
    return function is not None and any(op in STATEFUL_RANDOM_OPS for op, _ in unsupported_ops(function.graph))


def batched_examples(dataset: tf.data.Dataset) -> tf.data.Dataset | None:
    """The `.batch()` (or padded_batch, ...) whose batches are `dataset`'s elements, when it batched
    whole (features, labels[, weights]) examples and no `.unbatch()` undid it; else None. A batch of a
    stream of single values made into examples afterwards (sequences of tokens, then split into inputs
    and targets) is an example, not a batch."""
    name = type(dataset).__name__
    if "Unbatch" in name:
        return None
    if "Batch" in name:
        (source,) = dataset._inputs()
        spec = source.element_spec
        return dataset if isinstance(spec, tuple) and len(spec) in (2, 3) else None
    return next((found for d in dataset._inputs() if (found := batched_examples(d)) is not None), None)


PLAIN_BATCHES = ("_BatchDataset", "_ParallelBatchDataset")  # `.batch()`, with or without num_parallel_calls
ROW_KEEPERS = ("Prefetch", "Shuffle", "Cache", "Options", "Repeat", "Take", "Skip")  # keep each batch's rows


def keeps_rows(dataset: tf.data.Dataset, batch: tf.data.Dataset, size: int) -> bool:
    """Whether every step from `batch` up to `dataset` keeps each batch's rows (a prefetch, shuffle,
    cache, repeat, take or skip of whole batches, or a map whose output keeps the static batch `size`),
    so the examples' count follows from the number of batches."""
    while dataset is not batch:
        inputs, name = dataset._inputs(), type(dataset).__name__
        if len(inputs) != 1:
            return False
        if "Map" in name:
            if not all(s.shape.rank and s.shape[0] == size for s in tf.nest.flatten(dataset.element_spec)):
                return False
        elif not any(kind in name for kind in ROW_KEEPERS):
            return False
        dataset = inputs[0]
    return True


def single_examples(dataset: tf.data.Dataset) -> tuple[tf.data.Dataset, int | None]:
    """(`dataset` as single examples, the batch size it had). A pipeline whose last `.batch()` batches
    whole examples (the guides' `.batch(64)`, with a `.repeat()`, `.prefetch()`, a shuffle of the
    batches or maps of whole batches after it) is unbatched: exactly its examples, in its order (a
    stream: its batches are not read by position). Its count is declared where it follows from the
    batch's input (`keeps_rows`, and the same number of batches), else left unknown. Anything else is
    returned as it is, with None, for `DatasetSource.examples` to refuse: a padded batch, a batch of
    batches, and a batch that a later step changed into another structure, rank or first dimension."""
    batch = batched_examples(dataset)
    if batch is None or type(batch).__name__ not in PLAIN_BATCHES or batched_examples(batch._input_dataset) is not None:
        return dataset, None
    size, before, after = tf.get_static_value(batch._batch_size), batch._input_dataset.element_spec, dataset.element_spec
    if size is None:
        return dataset, None
    size = int(size)
    try:
        tf.nest.assert_same_structure(before, after)
    except (TypeError, ValueError):
        return dataset, None
    ranks = [(b.shape.rank, a.shape) for b, a in zip(tf.nest.flatten(before), tf.nest.flatten(after), strict=True)]
    if not all(rank is not None and shape.rank == rank + 1 and shape[0] in (None, size) for rank, shape in ranks):
        return dataset, None
    examples = dataset.unbatch()
    given = int(batch._input_dataset.cardinality().numpy()) if tf.executing_eagerly() else -2
    if given >= 0 and keeps_rows(dataset, batch, size):
        whole = tf.get_static_value(batch._drop_remainder)
        batches = given // size if whole else -(-given // size)
        if whole is not None and int(dataset.cardinality().numpy()) == batches:  # every batch is still there, once
            examples = examples.apply(tf.data.experimental.assert_cardinality(batches * size if whole else given))
    return examples, size


def captures_state(dataset: tf.data.Dataset) -> bool:
    """Whether `dataset` maps with a function that captures a resource: a lookup table (StringLookup,
    IntegerLookup, a `tf.lookup` table: TF's ParameterServerStrategy tutorial) or a variable."""
    function = getattr(getattr(dataset, "_map_func", None), "function", None)
    return function is not None and any(t.dtype == tf.resource for t in function.captured_inputs)


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
        was seen to crash the process); and one whose map captures a table or variable: on a worker,
        `at` runs such a map (a multi-device function: the lookup reads a resource) as a function whose
        return types are garbage ("Expected type INVALID for return value 0"), even read alone, where an
        iterator (the stream) runs it as TF's tutorial does."""
        if int(dataset.cardinality().numpy()) <= 0:
            return False
        if any("Shuffle" in type(d).__name__ or draws_at_random(d) or captures_state(d) for d in pipeline(dataset)):
            return False
        try:
            tf.data.experimental.at(dataset, 0)
        except (tf.errors.UnimplementedError, tf.errors.FailedPreconditionError):  # the op names the step that is not
            return False
        return True

    @staticmethod
    def made(make: Callable[[], tf.data.Dataset], what: str) -> tf.data.Dataset:
        """`make()` as single examples (`examples`)."""
        return DatasetSource.examples(make, what)[0]

    @staticmethod
    def examples(make: Callable[[], tf.data.Dataset], what: str) -> tuple[tf.data.Dataset, int | None]:
        """(`make()` checked to be a dataset, as single examples; the batch size its pipeline had, or None:
        `single_examples`). Made as the job wrote it (`as_written`): a worker may make it inside a closure
        that pstrain traces with AutoGraph off, and a map function's Python `if` on a tensor needs
        AutoGraph on where `map` is called."""
        try:
            with tables_made_here():  # one copy per worker where it traces the workers' pipeline
                dataset = as_written(make)()
        except RuntimeError as e:
            if "PreprocessingLayer.adapt" not in str(e):
                raise
            raise JobError(
                f"{what} adapts a preprocessing layer, and pstrain also builds the pipeline inside functions (for "
                "the workers), where Keras refuses adapt(); adapt the layer once outside it (at the job module's "
                "top level, or in a function cached with functools.cache) and use it in the map"
            ) from None
        if not isinstance(dataset, tf.data.Dataset):
            raise JobError(f"{what} must return a tf.data.Dataset of single examples, got {type(dataset).__name__}")
        dataset, size = single_examples(dataset)
        if (batch := batched_examples(dataset)) is not None:  # batches single_examples could not undo exactly
            shape = tf.nest.flatten(batch.element_spec)[0].shape
            raise JobError(
                f"{what}: its elements are batches (a .batch() of its examples: shape {shape.as_list()}) that pstrain "
                "cannot take apart exactly (a padded batch, a batch of batches, or a later step that changes their "
                "structure, rank or first dimension); give single examples, which pstrain batches to --global-batch-size"
            )
        return dataset, size

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
