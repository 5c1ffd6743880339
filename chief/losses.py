"""Keras losses reduced as `compile`/`fit` reduce them, split over the replica slots of a step.

Keras's weighted mean over a global batch of G examples is sum(w * l) / G (SUM_OVER_BATCH_SIZE,
the default for functions and `Loss` objects); a step averages the gradients of its N slots of
G / N examples, so each slot's loss is its own weighted mean sum(w * l) / (G / N), and the mean over
the slots is Keras's. With reduction SUM a slot's loss is N * sum(w * l): the mean is the global sum.
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf
import tf_keras

from chief.jobs import JobError

# What TensorFlow and Keras say when labels and predictions do not fit together.
_SHAPE_PROBLEM = re.compile(r"shape|dimension|rank|broadcast|incompatible|must have the same", re.I)


def _shape(nest: Any) -> str:
    return str(tf.nest.map_structure(lambda t: list(t.shape), nest))


def per_output_losses(loss_fn: Any, y_true: tf.Tensor, y_pred: tf.Tensor) -> tuple[tf.Tensor, str]:
    """The loss of one output before reduction and the reduction that applies to it."""
    if isinstance(loss_fn, tf_keras.losses.Loss):
        y_pred = tf.convert_to_tensor(y_pred)
        values = loss_fn.call(tf.cast(y_true, y_pred.dtype) if y_true.dtype.is_floating else y_true, y_pred)
        return values, loss_fn.reduction
    return loss_fn(y_true, y_pred), tf_keras.losses.Reduction.SUM_OVER_BATCH_SIZE


def reduce_slot(values: tf.Tensor, reduction: str, sample_weight, batch: int, num_slots: int, name: str) -> tf.Tensor:
    """One slot's share of the step loss from per-example (or already reduced, scalar) values."""
    values = tf.cast(values, tf.float32)
    if values.shape.rank == 0:
        if sample_weight is not None:
            raise JobError(
                f"{name} returned a scalar but train_data() gives sample weights; return one loss per example "
                "(as tf_keras.losses functions do) so the weights can apply"
            )
        return values  # taken as the mean over the slot's examples
    if values.shape.rank is None or (batch is not None and values.shape[0] not in (batch, None)):
        raise JobError(
            f"{name} returned a loss of shape {list(values.shape)} for a batch of {batch}; return a scalar "
            f"(the batch mean) or one loss per example (shape [{batch}] or [{batch}, ...])"
        )
    if sample_weight is not None:
        weight = tf.cast(tf.reshape(sample_weight, [batch] + [1] * (values.shape.rank - 1)), tf.float32)
        values = values * weight
    total = tf.reduce_sum(values)
    if reduction == tf_keras.losses.Reduction.SUM:
        return total * num_slots
    count = values.shape.num_elements()
    return total / (float(count) if count else tf.cast(tf.size(values), tf.float32))


def slot_loss(loss_fn: Any, labels: Any, predictions: Any, sample_weight: Any, num_slots: int) -> tf.Tensor:
    """The slot's loss (float32 scalar); one loss per output of a multi-output model, summed."""
    name = f"loss_fn ({type(loss_fn).__name__} object)" if isinstance(loss_fn, tf_keras.losses.Loss) else "loss_fn"
    try:
        tf.nest.assert_same_structure(labels, predictions)
    except (ValueError, TypeError):
        raise JobError(
            f"loss_fn: the labels {_shape(labels)} do not match the model's outputs {_shape(predictions)}; "
            "make train_data()'s labels the same nest (dict keys, tuple length) as the model's outputs"
        ) from None
    pairs = list(zip(tf.nest.flatten(labels), tf.nest.flatten(predictions), strict=True))
    weights = tf.nest.flatten(sample_weight) if sample_weight is not None else [None]
    if len(weights) not in (1, len(pairs)):
        raise JobError(f"train_data(): {len(weights)} sample weight arrays for {len(pairs)} outputs; give one, or one per output")
    total = []
    for i, (y_true, y_pred) in enumerate(pairs):
        y_pred = tf.convert_to_tensor(y_pred)
        if y_pred.dtype.is_floating and y_pred.dtype != tf.float32:
            y_pred = tf.cast(y_pred, tf.float32)  # mixed precision: the loss in float32, as Keras advises
        batch = y_pred.shape[0]
        try:
            values, reduction = per_output_losses(loss_fn, tf.convert_to_tensor(y_true), y_pred)
        except JobError:
            raise
        except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
            if not _SHAPE_PROBLEM.search(str(e)):
                raise  # a bug in loss_fn itself: reported with its file:line (cluster/errors.py user_error)
            message = " ".join(str(e).split())[:300]
            raise JobError(
                f"{name} failed on labels of shape {list(y_true.shape)} and model output of shape {list(y_pred.shape)} "
                f"({message}); make the labels match the model's output"
            ) from None
        weight = weights[i] if len(weights) > 1 else weights[0]
        total.append(reduce_slot(values, reduction, weight, batch, num_slots, name))
    return tf.add_n(total)
