"""The evaluation examples, read in batches where the evaluation runs, never all at once.

An evaluation runs in the chief (`--eval-every`, the final one) or in the evaluator sidecar
(`pstrain evaluate`, the `evaluator` task), each reading the job's eval set from its own disk:
`eval_dataset()` is iterated batch by batch (memory does not grow with the set), `eval_arrays()`
`.npy` files are memory-mapped, `eval_data()` arrays are sliced. Without any of them, the first (up
to) 8,192 training examples are the eval set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from chief.contract.arrays import batches_of, checked_arrays, rows
from chief.contract.job import Job, JobError

Batch = tuple  # (features, labels[, sample_weights]), each a tensor/array or a nest of them
FALLBACK_EXAMPLES = 8192


@dataclass(frozen=True)
class EvalSet:
    """`batches(size)` yields the whole set once, in order, `size` examples at a time."""

    batches: Callable[[int], Iterator[Batch]]
    what: str

    @classmethod
    def from_arrays(cls, data: Batch, what: str) -> EvalSet:
        n = len(tf.nest.flatten(data[0])[0])
        return cls(lambda size: (rows(data, slice(i, i + size)) for i in range(0, n, size)), what)

    @classmethod
    def from_dataset(cls, make: Callable[[], tf.data.Dataset], what: str) -> EvalSet:
        dataset = make()
        if not isinstance(dataset, tf.data.Dataset):
            raise JobError(f"{what} must return a tf.data.Dataset of single examples, got {type(dataset).__name__}")
        from worker.input.datasets import single_examples

        dataset = single_examples(dataset)[0]  # a guide's .batch(64): its examples, in its order
        if int(dataset.cardinality().numpy()) == tf.data.INFINITE_CARDINALITY:
            raise JobError(f"{what} repeats without end; an evaluation reads the set once: remove its .repeat()")
        spec = dataset.element_spec
        if not (isinstance(spec, tuple) and len(spec) in (2, 3)):
            raise JobError(f"{what}: each element must be (features, labels) or (features, labels, sample_weights)")
        return cls(lambda size: iter(dataset.batch(size)), what)


def eval_set(job: Job, first_training_examples: Callable[[int], Any]) -> EvalSet:
    """The job's eval set; `first_training_examples(n)` reads up to n training examples for the fallback."""
    spec = job.spec
    if job.eval_dataset:
        evaluation = EvalSet.from_dataset(job.eval_dataset, f"--job {spec}: eval_dataset()")
        refuse_batches(evaluation, first_training_examples)
        return evaluation
    if job.eval_arrays:
        from worker.input.tables import NpyFile

        what = f"--job {spec}: eval_arrays()"
        headers = tf.nest.map_structure(lambda p: NpyFile.read_header(str(p), what), tuple(job.eval_arrays()))
        data = tf.nest.map_structure(lambda f: np.load(f.path, mmap_mode="r"), headers)  # text too (fixed width)
        return EvalSet.from_arrays(checked_arrays(spec, "eval_arrays", data), what)
    if job.eval_data:
        return EvalSet.from_arrays(checked_arrays(spec, "eval_data", job.eval_data()), f"--job {spec}: eval_data()")
    first = first_training_examples(FALLBACK_EXAMPLES)
    return EvalSet.from_arrays(tuple(tf.nest.map_structure(np.asarray, first)), "the first training examples")


def refuse_batches(evaluation: EvalSet, first_training_examples: Callable[[int], Any]) -> None:
    """Raise JobError, before training, when the eval set's examples are batches: each of its features
    has one dimension more than the training examples' (a `.batch()` in `eval_dataset()`)."""
    from worker.input.datasets import one_shape

    with one_shape(evaluation.what):
        first = next(evaluation.batches(2), None)
    if first is None:
        return
    found, expected = tf.nest.flatten(first[0]), tf.nest.flatten(first_training_examples(1)[0])
    if not batches_of([list(f.shape[1:]) for f in found], [list(np.shape(e)[1:]) for e in expected]):
        return
    raise JobError(
        f"{evaluation.what}: its examples have shape {list(found[0].shape[1:])}, the training examples "
        f"{list(expected[0].shape[1:])}: it yields batches; give single examples, which pstrain batches (remove .batch())"
    )
