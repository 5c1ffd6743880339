"""A model's scores on the eval set: the training state (variables on the ps), the chief's mirror, or a restored copy."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras

from chief.contract.framework import EvalMetrics
from chief.contract.job import Job, JobError
from chief.data.eval_set import EvalSet


def evaluate(job: Job, model, data: EvalSet, batch: int = 1024) -> dict[str, float]:
    """eval_loss as Keras's `evaluate` counts it (the weighted loss over the outputs, plus the model's
    own losses of each evaluated batch: regularizers, `add_loss` in `call()`, activity regularizers),
    `eval_<name>` for every metric (`metrics_fn()`'s, or compile's, named as Keras names them:
    `<output>_<metric>` for several outputs), and for a job without metrics whose one output is a
    classifier's (rank-2 predictions, integer labels) `eval_accuracy`: Keras's own "accuracy" for that
    output (thresholded at 0.5 for one unit, sparse categorical otherwise).

    The set is read `batch` examples at a time: memory does not grow with it. Each output's loss is
    combined over batches exactly as one pass over the whole set reduces it (a mean, or a sum for SUM; a
    masked output's mean over the whole set's unmasked positions, as Keras's Loss reduces one batch);
    the model's own losses enter per batch, weighted by its examples, as `evaluate`'s loss mean does.
    """
    from worker.replica.losses import output_losses

    # In a function an embedding lookup reads only the rows it needs: called eagerly, a table split over
    # ps tasks was concatenated whole on the caller. The model's losses are read in the same call: they
    # are that call's tensors (an activity loss is the batch's), not to be read outside it; so are the
    # outputs' Keras masks, which a function's outputs lose (`with_masks` puts them back).
    @tf.function(reduce_retracing=True)
    def forward(x):
        predictions = model(x, training=False)
        own = [tf.cast(loss, tf.float32) for loss in model.losses]
        masks = [getattr(t, "_keras_mask", None) for t in tf.nest.flatten(predictions)]
        return predictions, masks, tf.add_n(own) if own else tf.constant(0.0)

    output_names = getattr(model, "output_names", None)
    metrics = metric_container(job, output_names)
    means, sums, own, examples = 0.0, 0.0, 0.0, 0
    masked: dict[int, list[float]] = {}  # output -> [sum of value * unmasked positions, unmasked positions]
    for part in data.batches(batch):
        features, labels = part[0], part[1]
        weights = part[2] if len(part) > 2 else None
        predictions, masks, own_losses = forward(features)
        with_masks(predictions, masks)
        n = len(tf.nest.flatten(labels)[0])
        for i, (value, reduction, count) in enumerate(output_losses(job, output_names, labels, predictions, weights, 1)):
            if reduction == tf_keras.losses.Reduction.SUM:
                sums += float(value)
            elif count is not None:  # a mean over a masked output's unmasked positions: over the whole set's
                if float(count):  # a batch with every position masked adds none (tf_keras's mean of it is NaN)
                    masked.setdefault(i, [0.0, 0.0])
                    masked[i][0] += float(value) * float(count)
                    masked[i][1] += float(count)
            else:
                means += float(value) * n
        own += float(own_losses) * n
        if metrics is None and not examples and is_classifier(predictions, labels):
            metrics = default_accuracy(job, output_names)
        examples += n
        if metrics is not None:
            metrics.update_state(tensors(labels), predictions, sample_weight=tensors(weights))
    if not examples:
        raise JobError(f"{data.what} is empty; give at least one example to evaluate on")
    result = {"eval_loss": (means + own) / examples + sums + sum(total / count for total, count in masked.values())}
    for name, value in (metrics.results() if metrics is not None else {}).items():
        result[f"eval_{name}"] = value
    return result


def with_masks(predictions: Any, masks: list) -> None:
    """Give each output its Keras mask (or none) again, for the losses and metrics that apply it."""
    for output, mask in zip(tf.nest.flatten(predictions), masks, strict=True):
        if mask is not None:
            output._keras_mask = mask


def is_classifier(predictions: Any, labels: Any) -> bool:
    """One output of rank-2 predictions with integer labels: what gets a default accuracy."""
    return tf.is_tensor(predictions) and predictions.shape.rank == 2 and np.asarray(labels).dtype.kind in "iu"


def default_accuracy(job: Job, output_names) -> EvalMetrics:
    """Keras's "accuracy" as `compile(metrics=["accuracy"])` resolves it for the output (unweighted):
    binary_accuracy (threshold 0.5) for one unit, sparse_categorical_accuracy for several."""
    return EvalMetrics(job.framework, ["accuracy"], None, output_names)


def tensors(nest: Any) -> Any:
    """A nest of arrays as tensors (None stays None): what Keras's metric containers take."""
    return None if nest is None else tf.nest.map_structure(tf.convert_to_tensor, nest)


def metric_container(job: Job, output_names) -> EvalMetrics | None:
    """Fresh metrics for one evaluation, matched to the outputs as `compile` matches them: the job's
    `metrics_fn()` (weighted by the sample weights, as before), or compile's metrics and weighted_metrics.
    None when the job has none."""
    if job.metrics_fn:
        return EvalMetrics(job.framework, None, list(job.metrics_fn()), output_names)
    if job.compiled_metrics:
        metrics, weighted = job.compiled_metrics()
        if metrics or weighted:
            return EvalMetrics(job.framework, metrics, weighted, output_names)
    return None
