"""Evaluation and SavedModel export of a local model (the checkpoint mirror, or a restored copy)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from chief.jobs import Job, rows


def predict(model, features: Any, batch: int = 1024) -> Any:
    """The model's outputs on every row of a features nest, in batches."""
    n = len(tf.nest.flatten(features)[0])
    parts = [model(rows(features, slice(i, i + batch)), training=False) for i in range(0, n, batch)]
    return tf.nest.map_structure(lambda *p: np.concatenate([np.asarray(x, dtype=np.float32) for x in p]), *parts)


def evaluate(job: Job, model, data: tuple, batch: int = 1024) -> dict[str, float]:
    """eval_loss (Keras's weighted mean, plus the model's own losses), eval_accuracy for a single
    classifier output without metrics_fn, and `eval_<name>` for every metric of `metrics_fn()`."""
    from chief.losses import slot_loss

    features, labels = data[0], data[1]
    weights = data[2] if len(data) > 2 else None
    predictions = predict(model, features, batch)
    loss = slot_loss(job.loss_fn, labels, predictions, weights, num_slots=1)
    if model.losses:
        loss += tf.add_n([tf.cast(x, tf.float32) for x in model.losses])
    result = {"eval_loss": float(loss)}
    if job.metrics_fn:
        for metric in job.metrics_fn():
            for start in range(0, len(tf.nest.flatten(labels)[0]), batch):
                part = slice(start, start + batch)
                weight = None if weights is None else rows(weights, part)
                metric.update_state(rows(labels, part), rows(predictions, part), sample_weight=weight)
            result[f"eval_{metric.name}"] = float(metric.result())
    elif isinstance(predictions, np.ndarray) and predictions.ndim == 2 and np.issubdtype(np.asarray(labels).dtype, np.integer):
        result["eval_accuracy"] = float(np.mean(np.argmax(predictions, axis=1) == np.asarray(labels).reshape(-1)))
    return result


def serving_spec(sample: Any) -> Any:
    """TensorSpecs for the features nest: named by dict key (a single array is "features")."""
    if isinstance(sample, dict):
        return {k: tf.TensorSpec([None, *np.shape(v)[1:]], tf.as_dtype(np.asarray(v).dtype), name=k) for k, v in sample.items()}
    flat = tf.nest.flatten(sample)
    names = ["features"] if len(flat) == 1 else [f"features_{i}" for i in range(len(flat))]
    specs = [tf.TensorSpec([None, *np.shape(v)[1:]], tf.as_dtype(v.dtype), name=n) for v, n in zip(flat, names, strict=True)]
    return tf.nest.pack_sequence_as(sample, specs)


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
