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
    """eval_loss (Keras's weighted loss over the outputs, plus the model's own losses), eval_accuracy for
    a single classifier output without metrics, and `eval_<name>` for every metric (`metrics_fn()`'s,
    or compile's, named as Keras names them: `<output>_<metric>` for several outputs).

    The set is read `batch` examples at a time: memory does not grow with it. Each output's loss is
    combined over batches exactly as one pass over the whole set reduces it (a mean, or a sum for SUM).
    """
    from worker.replica.losses import output_losses

    # In a function an embedding lookup reads only the rows it needs: called eagerly, a table split over
    # ps tasks was concatenated whole on the caller.
    predict = tf.function(lambda x: model(x, training=False), reduce_retracing=True)
    output_names = getattr(model, "output_names", None)
    metrics = metric_container(job, output_names)
    means, sums, examples, correct, classifier = 0.0, 0.0, 0, 0, metrics is None
    for part in data.batches(batch):
        features, labels = part[0], part[1]
        weights = part[2] if len(part) > 2 else None
        predictions = predict(features)
        n = len(tf.nest.flatten(labels)[0])
        for value, reduction in output_losses(job, output_names, labels, predictions, weights, num_slots=1):
            if reduction == tf_keras.losses.Reduction.SUM:
                sums += float(value)
            else:
                means += float(value) * n
        examples += n
        if metrics is not None:
            labels_t, weights_t = (
                None if x is None else tf.nest.map_structure(tf.convert_to_tensor, x) for x in (labels, weights)
            )
            metrics.update_state(labels_t, predictions, sample_weight=weights_t)
        if classifier and tf.is_tensor(predictions) and predictions.shape.rank == 2 and np.asarray(labels).dtype.kind in "iu":
            correct += int(np.sum(np.argmax(predictions, axis=1) == np.asarray(labels).reshape(-1)))
        else:
            classifier = False
    if not examples:
        raise JobError(f"{data.what} is empty; give at least one example to evaluate on")
    result = {"eval_loss": means / examples + sums}
    if model.losses:
        result["eval_loss"] += float(tf.add_n([tf.cast(x, tf.float32) for x in model.losses]))
    for name, value in (metrics.results() if metrics is not None else {}).items():
        result[f"eval_{name}"] = value
    if classifier:
        result["eval_accuracy"] = correct / examples
    return result


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
