"""Elements of a random-access `tf.data.Dataset` by position, as one batch (`read_positions`).

The general route is `tf.data.experimental.at` per element in a parallel map, which makes an iterator
over the whole pipeline for each element. The pipelines users write most (TF's guides: a
`Dataset.range(n)` or `Dataset.from_tensor_slices(arrays)`, then `map`s) have a cheaper route with the
same elements: the source's rows at the positions (the range's values, or one `tf.gather` per array),
then the pipeline's own map functions over them, in order (`source_and_maps`). Element i of such a
pipeline is its maps applied to source row i, and a pipeline read by position has maps without
random draws or state (worker/input/datasets.py sends any other to the streaming reader), so both
routes give the same bits (tests/worker/input/test_position_reads.py). Anything else takes the general route.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.data.ops import from_tensor_slices_op, map_op, range_op

from worker.input.sources import READ_PARALLELISM

Nest = Any
MAPS = (map_op._MapDataset, map_op._ParallelMapDataset)


def dense(spec: Nest) -> bool:
    return all(type(s) is tf.TensorSpec for s in tf.nest.flatten(spec))


def source_and_maps(dataset: tf.data.Dataset) -> tuple[tf.data.Dataset, list] | None:
    """(the range or tensor-slices source, its map functions in order) when `dataset` is only maps over
    one, every element along the way made of dense tensors; else None."""
    maps = []
    while isinstance(dataset, MAPS):
        function = dataset._map_func
        if not (dense(function._input_structure) and dense(function.output_structure)):
            return None
        maps.append(function)
        dataset = dataset._input_dataset
    sliced = isinstance(dataset, from_tensor_slices_op._TensorSliceDataset) and dense(dataset.element_spec)
    if not (isinstance(dataset, range_op._RangeDataset) or sliced):
        return None
    return dataset, maps[::-1]


def source_rows(source: tf.data.Dataset, indices: tf.Tensor) -> Nest:
    """Rows `indices` of a range or tensor-slices source, batched (the structure of its elements)."""
    if isinstance(source, range_op._RangeDataset):
        values = source._start + tf.cast(indices, tf.int64) * source._step
        return tf.cast(values, source.element_spec.dtype)
    return tf.nest.pack_sequence_as(source.element_spec, [tf.gather(t, indices) for t in source._tensors])


def applied(function: Any) -> Any:
    """The map function as tf.data calls it: its element's tensors flat in, its result's flat out."""

    def call(*element):
        flat = tf.nest.flatten(element[0] if len(element) == 1 else element)
        return tf.nest.pack_sequence_as(function.output_structure, function.function(*flat))

    return call


def read_positions(dataset: tf.data.Dataset, indices: tf.Tensor) -> Nest:
    """TF ops: elements `indices` of a random-access dataset, read in parallel, in order, as one batch
    (of a static size when `indices` has one: what a slot's loss reshapes its sample weights to)."""
    n = indices.shape[0]
    if (found := source_and_maps(dataset)) is not None:
        source, maps = found
        reads = tf.data.Dataset.from_tensor_slices(source_rows(source, indices))
        for function in maps:
            reads = reads.map(applied(function), num_parallel_calls=READ_PARALLELISM, deterministic=True)
    else:
        reads = tf.data.Dataset.from_tensor_slices(indices).map(
            lambda i: tf.data.experimental.at(dataset, i), num_parallel_calls=READ_PARALLELISM, deterministic=True
        )
    if n is not None:  # exactly n elements: one full batch, with its size in the static shape
        return reads.batch(n, drop_remainder=True).get_single_element()
    return reads.batch(tf.size(indices, out_type=tf.int64)).get_single_element()
