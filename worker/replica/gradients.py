"""Gradients as a replica hands them over: dense tensors, or row slices for tables (embeddings).

A variable whose gradient TensorFlow produces as `IndexedSlices` (an embedding lookup, any
`tf.gather` of a variable) is *row-sparse*: a step touches a few rows of it, and only those rows
should cross the network and be updated. Such gradients stay sparse from the worker to the apply;
every other gradient is dense. Which variables are row-sparse is found once by tracing the model
(`sparse_variables`); a gradient of the other kind than expected is converted, so the choice only
ever affects speed, never the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from chief.contract.arrays import tensor_dtype
from chief.contract.framework import trainable_of

Gradient = tf.Tensor | tf.IndexedSlices


def sparse_variables(model, sample_features) -> list[bool]:
    """For each of `model.trainable_variables`: does its gradient come as row slices? Traced, not run."""
    variables = trainable_of(model)

    def probe(features):
        with tf.GradientTape() as tape:
            outputs = tf.nest.flatten(model(features, training=False))
            loss = tf.add_n(
                [tf.reduce_sum(tf.cast(o, tf.float32)) for o in outputs] + [tf.cast(x, tf.float32) for x in model.losses]
            )
        return tape.gradient(loss, variables)

    specs = tf.nest.map_structure(lambda a: tf.TensorSpec([None, *a.shape[1:]], tensor_dtype(a)), sample_features)
    grads = tf.function(probe).get_concrete_function(specs).structured_outputs
    return [isinstance(g, tf.IndexedSlices) for g in grads]


def unique_rows(gradient: Gradient | None, variable) -> tf.IndexedSlices:
    """Row slices with each row once (duplicates summed) and indices sorted, as the ps-side
    accumulator's merge requires. A missing gradient is no rows; a dense one is every row."""
    shape = tf.constant(variable.shape.as_list(), tf.int64)
    if gradient is None:
        empty = tf.zeros([0, *variable.shape[1:]], variable.dtype)
        return tf.IndexedSlices(empty, tf.zeros([0], tf.int64), shape)
    if not isinstance(gradient, tf.IndexedSlices):
        rows = tf.range(tf.shape(gradient, out_type=tf.int64)[0])
        return tf.IndexedSlices(tf.convert_to_tensor(gradient), rows, shape)
    return summed_rows(gradient, shape)


def summed_rows(slices: tf.IndexedSlices, shape: tf.Tensor) -> tf.IndexedSlices:
    """`slices` with each row once, its duplicates summed in the order they come, indices sorted.

    Also what makes a step's update repeatable: TF's CPU scatter (ResourceScatterAdd, legacy SGD's
    sparse update) splits more than 1,023 indices over threads, so two values for one row are added in
    whichever order the threads reach them (the last bit differs run to run); unique rows leave no order.
    """
    # Sorted first (stable: a row's duplicates keep their order), then summed by runs: a sorted segment
    # sum, which costs less than an unsorted one followed by a sort of its rows.
    indices = tf.cast(slices.indices, tf.int64)
    order = tf.argsort(indices, stable=True)
    rows, runs = tf.unique(tf.gather(indices, order))
    return tf.IndexedSlices(tf.math.segment_sum(tf.gather(slices.values, order), runs), rows, shape)


def replica_gradients(grads: Sequence[Gradient | None], variables, sparse: Sequence[bool]) -> list[Gradient]:
    """One replica's gradients, ready to push: dense (zeros where the loss does not touch a
    variable) or, for row-sparse variables, `unique_rows`."""
    out: list[Gradient] = []
    for grad, variable, rows in zip(grads, variables, sparse, strict=True):
        if rows:
            out.append(unique_rows(grad, variable))
        else:
            out.append(tf.zeros_like(variable) if grad is None else tf.convert_to_tensor(grad))
    return out


def mean_of_slots(per_slot: Sequence[Sequence[Gradient]], count: int) -> list[Gradient]:
    """The mean over `count` slots: dense gradients averaged; row slices joined (slot 0 first) with
    values divided by `count`, then each row's values summed in slot order (`summed_rows`), so a row
    gets the same mean a dense variable gets (a row touched by one slot weighs 1/count, not 1)."""
    means: list[Gradient] = []
    for grads in zip(*per_slot, strict=True):
        if isinstance(grads[0], tf.IndexedSlices):
            values = tf.concat([g.values for g in grads], axis=0) / tf.cast(count, grads[0].values.dtype)
            joined = tf.IndexedSlices(values, tf.concat([g.indices for g in grads], axis=0), grads[0].dense_shape)
            means.append(summed_rows(joined, grads[0].dense_shape))
        else:
            means.append(tf.add_n(list(grads)) / tf.cast(count, grads[0].dtype))
    return means
