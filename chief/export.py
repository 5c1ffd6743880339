"""Evaluation and SavedModel export from a local copy of the trained weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import tensorflow as tf

from chief.jobs import Job


def local_model(job: Job, weights, sample: np.ndarray):
    model = job.model_fn()
    model(sample, training=False)
    model.set_weights(weights)
    return model


def evaluate(job: Job, model, data: tuple[np.ndarray, np.ndarray], batch: int = 1024) -> dict[str, float]:
    features, labels = data
    predictions = np.concatenate([model(features[i : i + batch], training=False).numpy() for i in range(0, len(features), batch)])
    result = {"eval_loss": float(job.loss_fn(labels, predictions))}
    if predictions.ndim == 2 and np.issubdtype(labels.dtype, np.integer):
        result["eval_accuracy"] = float(np.mean(np.argmax(predictions, axis=1) == labels.reshape(-1)))
    return result


def export_saved_model(model, sample: np.ndarray, path: Path) -> None:
    """Write a SavedModel whose serving_default maps features to predictions; atomic on success."""
    spec = tf.TensorSpec([None, *sample.shape[1:]], tf.as_dtype(sample.dtype), name="features")
    module = tf.Module()
    module.model = model
    module.serve = tf.function(lambda x: {"predictions": model(x, training=False)}, input_signature=[spec])
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tf.saved_model.save(module, str(tmp), signatures={"serving_default": module.serve})
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
