"""Evaluation and SavedModel export of a local model (the checkpoint mirror, or a restored copy)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras

from chief.eval_set import EvalSet
from chief.jobs import Job, JobError, tensor_dtype


def evaluate(job: Job, model, data: EvalSet, batch: int = 1024) -> dict[str, float]:
    """eval_loss (Keras's weighted mean, plus the model's own losses), eval_accuracy for a single
    classifier output without metrics_fn, and `eval_<name>` for every metric of `metrics_fn()`.

    The set is read `batch` examples at a time: memory does not grow with it. The loss is combined
    over batches exactly as one pass over the whole set reduces it (a mean, or a sum for SUM).
    """
    from chief.losses import slot_loss

    summed = isinstance(job.loss_fn, tf_keras.losses.Loss) and job.loss_fn.reduction == tf_keras.losses.Reduction.SUM
    metrics = list(job.metrics_fn()) if job.metrics_fn else []
    loss, examples, correct, classifier = 0.0, 0, 0, not metrics
    for part in data.batches(batch):
        features, labels = part[0], part[1]
        weights = part[2] if len(part) > 2 else None
        predictions = model(features, training=False)
        n = len(tf.nest.flatten(labels)[0])
        value = float(slot_loss(job.loss_fn, labels, predictions, weights, num_slots=1))
        loss += value if summed else value * n
        examples += n
        for metric in metrics:
            metric.update_state(labels, predictions, sample_weight=weights)
        if classifier and tf.is_tensor(predictions) and predictions.shape.rank == 2 and np.asarray(labels).dtype.kind in "iu":
            correct += int(np.sum(np.argmax(predictions, axis=1) == np.asarray(labels).reshape(-1)))
        else:
            classifier = False
    if not examples:
        raise JobError(f"{data.what} is empty; give at least one example to evaluate on")
    result = {"eval_loss": (loss if summed else loss / examples)}
    if model.losses:
        result["eval_loss"] += float(tf.add_n([tf.cast(x, tf.float32) for x in model.losses]))
    for metric in metrics:
        result[f"eval_{metric.name}"] = float(metric.result())
    if classifier:
        result["eval_accuracy"] = correct / examples
    return result


def serving_spec(sample: Any) -> Any:
    """TensorSpecs for the features nest: named by dict key (a single array is "features"); text is tf.string."""

    def spec(value, name: str) -> tf.TensorSpec:
        return tf.TensorSpec([None, *np.shape(value)[1:]], tensor_dtype(np.asarray(value)), name=name)

    if isinstance(sample, dict):
        return {k: spec(v, k) for k, v in sample.items()}
    flat = tf.nest.flatten(sample)
    names = ["features"] if len(flat) == 1 else [f"features_{i}" for i in range(len(flat))]
    return tf.nest.pack_sequence_as(sample, [spec(v, n) for v, n in zip(flat, names, strict=True)])


def export_saved_model(model, sample: Any, path: Path) -> None:
    """Write a SavedModel whose serving_default maps features (by name, for a dict of inputs) to
    {"predictions": ...} (or one output per name for a dict of outputs); atomic on success."""
    spec = serving_spec(sample)

    def outputs(y):
        return dict(y) if isinstance(y, dict) else {"predictions": y}

    module = tf.Module()
    module.model = model
    if isinstance(spec, dict):
        module.serve = tf.function(lambda **x: outputs(model(x, training=False)), input_signature=None)
        concrete = module.serve.get_concrete_function(**spec)
    else:
        module.serve = tf.function(lambda x: outputs(model(x, training=False)), input_signature=[spec])
        concrete = module.serve
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tf.saved_model.save(module, str(tmp), signatures={"serving_default": concrete})
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
