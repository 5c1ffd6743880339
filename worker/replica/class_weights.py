"""`class_weight = {label: weight}` on a job, applied as Keras's `fit(class_weight=...)` applies it.

Keras turns the class weights into per-example weights on each training batch
(`tf_keras/src/engine/data_adapter.py` `_make_class_weight_map_fn`): the weight of each example's
class (its label, rounded; the argmax of a one-hot label), multiplied into the example's sample
weight where there is one. Only for a model with one output; keys must be 0 .. n-1 (checked at
load: chief/contract/job.py `checked_class_weight`). Evaluation is
not weighted by class (as `evaluate` takes no class_weight). The same ops run in both engines on each
slot's batch, so the cluster run equals the standalone one.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from cluster.errors import JobError


def class_weighted(class_weight: dict[int, float], labels: Any, sample_weight: Any) -> tf.Tensor:
    """A batch's per-example weights: its labels' class weights, times `sample_weight` if given."""
    if tf.nest.is_nested(labels):
        found = tf.nest.map_structure(lambda t: list(t.shape), labels)
        raise JobError(
            f"class_weight: only for a model with one output, as in fit (labels {found}); "
            "give per-example sample weights for several outputs"
        )
    table = tf.constant([class_weight[c] for c in range(len(class_weight))], tf.float32)
    labels = tf.convert_to_tensor(labels)
    if labels.shape.rank is not None and labels.shape.rank >= 2:
        classes = tf.__internal__.smart_cond.smart_cond(
            tf.shape(labels)[-1] > 1,
            lambda: tf.argmax(labels, axis=-1),
            lambda: tf.cast(tf.round(tf.squeeze(labels, axis=-1)), tf.int64),
        )
    else:  # rank 1: sparse labels
        classes = tf.cast(tf.round(labels), tf.int64)
    weights = tf.gather(table, classes)
    if sample_weight is None:
        return weights
    if tf.nest.is_nested(sample_weight):
        raise JobError("class_weight: sample weights must be one array (one output), as in fit")
    sample_weight = tf.convert_to_tensor(sample_weight)
    weights = tf.cast(weights, sample_weight.dtype)
    extra = weights.shape.rank - sample_weight.shape.rank
    if extra > 0:  # Keras's reshape of sample_weight to weights' rank, by the dynamic shape
        sample_weight = tf.reshape(sample_weight, tf.concat([tf.shape(sample_weight), [1] * extra], 0))
    return sample_weight * weights
