"""Keras losses reduced as `compile`/`fit` reduce them, split over the replica slots of a step.

Keras's weighted mean over a global batch of G examples is sum(w * l) / G (SUM_OVER_BATCH_SIZE,
the default for functions and `Loss` objects); a step averages the gradients of its N slots of
G / N examples, so each slot's loss is its own weighted mean sum(w * l) / (G / N), and the mean over
the slots is Keras's. With reduction SUM a slot's loss is N * sum(w * l): the mean is the global sum.
A multi-output model's loss is, as in `fit`, the sum over its outputs of each output's loss (so
reduced) times its loss weight; losses, loss weights, labels and sample weights are matched to the
outputs as Keras's compile containers match them (a dict by output name, one item for all outputs).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
import tf_keras
from tf_keras.src.engine import compile_utils

from chief.contract.as_written import as_written
from chief.contract.framework import TF_KERAS, refuse_masked_output
from chief.contract.framework import loss_object as framework_loss_object
from chief.contract.job import Job, JobError

# What TensorFlow and Keras say when labels and predictions do not fit together.
_SHAPE_PROBLEM = re.compile(r"shape|dimension|rank|broadcast|incompatible|must have the same", re.I)


def _shape(nest: Any) -> str:
    return str(tf.nest.map_structure(lambda t: list(t.shape), nest))


def conform(struct: Any, predictions: Any, output_names: Sequence[str] | None) -> Any:
    """`struct` (labels, weights, losses or loss weights) as the nest of the model's outputs, as
    Keras's compile containers conform it: a dict keyed by output name for a list of outputs, missing
    keys as None, one item for every output."""
    struct = compile_utils.map_to_output_names(predictions, output_names, struct)
    struct = compile_utils.map_missing_dict_keys(predictions, struct)
    if not tf.nest.is_nested(struct) and tf.nest.is_nested(predictions):
        struct = tf.nest.map_structure(lambda _: struct, predictions)
    return struct


def loss_object(loss: Any, framework: str = TF_KERAS) -> Any:
    """A `Loss`-like object (`call` and `reduction`) for one output's loss (a name, a function or a
    `Loss` of the job's framework), as `compile` makes it (chief/contract/framework.py); None for no loss."""
    return None if loss is None else framework_loss_object(framework, loss)


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
    if sample_weight is not None:  # one weight per example, over the example's loss values
        rows = batch if batch is not None else tf.shape(values)[0]  # a batch of unknown static size: its own
        weight = tf.reshape(sample_weight, tf.stack([rows] + [1] * (values.shape.rank - 1)))
        values = values * tf.cast(weight, tf.float32)
    total = tf.reduce_sum(values)
    if reduction == tf_keras.losses.Reduction.SUM:
        return total * num_slots
    count = values.shape.num_elements()
    return total / (float(count) if count else tf.cast(tf.size(values), tf.float32))


def output_losses(
    job: Job, output_names: Sequence[str] | None, labels: Any, predictions: Any, sample_weight: Any, num_slots: int
) -> list[tuple[tf.Tensor, str]]:
    """Per output with a loss: the slot's share of it (float32 scalar, times its loss weight) and its
    reduction, for the job's loss (one, or a list or dict per output) and loss weights."""
    what = job.loss_name
    try:
        labels = conform(labels, predictions, output_names)
        tf.nest.assert_same_structure(labels, predictions)
    except (ValueError, TypeError):
        raise JobError(
            f"{what}: the labels {_shape(labels)} do not match the model's outputs {_shape(predictions)}; "
            "make train_data()'s labels the same nest (dict keys, tuple length) as the model's outputs"
        ) from None
    flat = tf.nest.flatten(predictions)
    losses = _per_output(what, job.loss_fn, predictions, output_names, len(flat))
    loss_weights = _per_output("loss_weights", job.loss_weights, predictions, output_names, len(flat))
    if sample_weight is not None and tf.nest.is_nested(sample_weight):
        sample_weight = conform(sample_weight, predictions, output_names)  # a dict by output name
    weights = tf.nest.flatten(sample_weight) if sample_weight is not None else [None]
    if len(weights) not in (1, len(flat)):
        raise JobError(f"train_data(): {len(weights)} sample weight arrays for {len(flat)} outputs; give one, or one per output")
    results = []
    for i, (y_true, y_pred) in enumerate(zip(tf.nest.flatten(labels), flat, strict=True)):
        loss = loss_object(losses[i], job.framework)
        if y_true is None or loss is None:  # an output without a loss (Keras allows it)
            continue
        refuse_masked_output(what, job.framework, y_pred)
        y_pred = tf.convert_to_tensor(y_pred)
        if y_pred.dtype.is_floating and y_pred.dtype != tf.float32:
            y_pred = tf.cast(y_pred, tf.float32)  # mixed precision: the loss in float32, as Keras advises
        weight = weights[i] if len(weights) > 1 else weights[0]
        name = f"{what}[{_output_name(predictions, output_names, i)}]" if len(flat) > 1 else what
        try:
            y_t, y_p, _ = compile_utils.match_dtype_and_rank(tf.convert_to_tensor(y_true), y_pred, None)
            values = as_written(loss.call)(y_t, y_p)
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
        value = reduce_slot(values, loss.reduction, weight, y_pred.shape[0], num_slots, name)
        if loss_weights[i] is not None:
            value = value * float(loss_weights[i])
        results.append((value, loss.reduction))
    if not results:
        raise JobError(
            f"{what}: no output has a loss; give a loss for at least one of {_output_names(predictions, output_names)}"
        )
    return results


def slot_loss(
    job: Job, output_names: Sequence[str] | None, labels: Any, predictions: Any, sample_weight: Any, num_slots: int
) -> tf.Tensor:
    """The slot's loss (float32 scalar): Keras's weighted sum over the outputs of their losses."""
    return tf.add_n([value for value, _ in output_losses(job, output_names, labels, predictions, sample_weight, num_slots)])


def _output_names(predictions: Any, output_names: Sequence[str] | None) -> list[str]:
    if isinstance(predictions, dict):
        return sorted(predictions)
    flat = tf.nest.flatten(predictions)
    names = list(output_names or [])
    return names if len(names) == len(flat) else compile_utils.create_pseudo_output_names(predictions)


def _output_name(predictions: Any, output_names: Sequence[str] | None, i: int) -> str:
    return _output_names(predictions, output_names)[i]


def _per_output(what: str, struct: Any, predictions: Any, output_names: Sequence[str] | None, count: int) -> list:
    """`struct` (losses or loss weights) as one entry per flattened output (None: nothing for it)."""
    if struct is None:
        return [None] * count
    names = _output_names(predictions, output_names)
    if isinstance(struct, dict) and set(struct) - set(names):
        unknown = ", ".join(repr(k) for k in sorted(set(struct) - set(names)))
        raise JobError(f"{what}: no output named {unknown}; the model's outputs are {names}")
    try:
        flat = tf.nest.flatten(conform(struct, predictions, output_names))
    except (ValueError, TypeError) as e:
        message = " ".join(str(e).split())[:200]
        raise JobError(
            f"{what}: does not fit the model's outputs {_output_names(predictions, output_names)} ({message})"
        ) from None
    if len(flat) != count:
        raise JobError(
            f"{what}: {len(flat)} entries for {count} outputs {names}; "
            "give one per output (a list in output order, or a dict by output name)"
        )
    return flat
