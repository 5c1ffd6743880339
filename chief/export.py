"""SavedModel export of a local model (the checkpoint mirror, or a restored copy)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from tf_keras.src.saving.legacy.saved_model.utils import keras_option_scope

from chief.contract.arrays import tensor_dtype
from cluster.errors import WriteError, writing


def declared_shapes(model: Any, sample: Any) -> Any:
    """The shapes of the model's own inputs (`Input(shape=...)`, batch dimension None) in the nest of
    `sample`, None for each one the model does not declare (a subclassed model, a Sequential without Input)."""
    declared = getattr(model, "_nested_inputs", None)
    if isinstance(sample, dict) and isinstance(declared, dict):
        return {k: list(declared[k].shape) if k in declared else None for k in sample}
    if not isinstance(sample, dict) and not tf.nest.is_nested(sample) and hasattr(declared, "shape"):
        return list(declared.shape)
    return tf.nest.map_structure(lambda _: None, sample)


def serving_spec(sample: Any, model: Any = None) -> Any:
    """TensorSpecs for the features nest: named by dict key (a single array is "features"); text is
    tf.string; each in the shape the model declares for it (`Input(shape=(1,))` takes [None, 1], as
    Keras feeds a column of shape [None] to it), else in the data's."""

    def spec(value, name: str, shape=None) -> tf.TensorSpec:
        return tf.TensorSpec(shape or [None, *np.shape(value)[1:]], tensor_dtype(np.asarray(value)), name=name)

    shapes = declared_shapes(model, sample)
    if isinstance(sample, dict):
        return {k: spec(v, k, shapes[k]) for k, v in sample.items()}
    if shapes is not None and not tf.nest.is_nested(shapes):
        return spec(sample, "features", shapes)
    flat = tf.nest.flatten(sample)
    names = ["features"] if len(flat) == 1 else [f"features_{i}" for i in range(len(flat))]
    return tf.nest.pack_sequence_as(sample, [spec(v, n) for v, n in zip(flat, names, strict=True)])


def export_saved_model(model, sample: Any, path: Path) -> None:
    """Write a SavedModel whose serving_default maps features (by name, for a dict of inputs) to
    {"predictions": ...}, or one output per name for a dict of outputs, or for a list or tuple of
    outputs one per `model.output_names` (a functional model's output layers), else `output_1`,
    `output_2`, ... as Keras names them; atomic on success.

    Keras's own traces of every layer's call are left out (as `model.save(save_traces=False)`): the
    signature is what serves, and Keras traced a subclassed layer's `call` with AutoGraph off, so a job
    whose layer branches on a tensor in Python trained and then failed here."""
    spec = serving_spec(sample, model)

    def outputs(y):
        if isinstance(y, dict):
            return dict(y)
        flat = tf.nest.flatten(y)
        if len(flat) == 1:
            return {"predictions": flat[0]}
        names = list(getattr(model, "output_names", None) or [])
        if len(set(names)) != len(flat):
            names = [f"output_{i + 1}" for i in range(len(flat))]  # as Keras names them in metrics
        return dict(zip(names, flat, strict=True))

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
    try:
        with writing(path), keras_option_scope(save_traces=False):
            tf.saved_model.save(module, str(tmp), signatures={"serving_default": concrete})
    except WriteError:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written model left behind
        raise
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
