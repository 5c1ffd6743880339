"""The job contract: `Job`, `load_job` for `--job package.module[:attr]`, `JobError`, and the checks on a job's data."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.errors import ConfigError

TRAIN_SOURCES = ("train_dataset", "train_arrays", "train_data")  # exactly one; see chief/data/sources.py
OPTIONAL = ("eval_dataset", "eval_arrays", "eval_data", "metrics_fn", "loss_weights")


class JobError(ConfigError):
    """A job that cannot be used; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Job:
    spec: str
    model_fn: Callable[[], Any]
    loss_fn: Any  # a function (scalar or per-example losses), a tf_keras Loss, a loss name, or a list/dict of those per output
    optimizer_fn: Callable[[], Any]  # a fresh optimizer per call
    train_data: Callable[[], tuple] | None  # (features, labels[, sample_weights]) arrays or nests of arrays
    eval_data: Callable[[], tuple] | None
    metrics_fn: Callable[[], list] | None = None
    train_arrays: Callable[[], Any] | None = None  # the same as paths of .npy files
    eval_arrays: Callable[[], Any] | None = None
    train_dataset: Callable[[], Any] | None = None  # a tf.data.Dataset of single (features, labels[, weights]) examples
    eval_dataset: Callable[[], Any] | None = None
    loss_weights: Any = None  # None, a number, or a list/dict per output (as compile's loss_weights)
    loss_name: str = "loss_fn"  # where the loss came from, for messages
    compiled_metrics: Callable[[], tuple[Any, Any]] | None = None  # fresh (metrics, weighted_metrics) from compile
    class_weight: dict[int, float] | None = None  # {label: weight}, as fit's class_weight (chief/step/class_weights.py)

    @property
    def name(self) -> str:
        return self.spec.replace(":", ".").rsplit(".", 1)[-1]


def load_job(spec: str) -> Job:
    """Import `package.module` or `package.module:attr` and check it offers the job API. What the job
    does not define (loss_fn, optimizer_fn, metrics_fn, loss_weights) is taken from the model's
    `compile()`, if `model_fn()` compiles it (chief/job_compiled.py)."""
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise JobError(f"--job {spec}: cannot import {module_name} ({e}); check the module path and PYTHONPATH") from None
    if attr:
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise JobError(f"--job {spec}: {module_name} has no attribute {attr!r}") from None
    from chief.job_compiled import job_parts
    from chief.step.class_weights import checked_class_weight

    if not callable(getattr(target, "model_fn", None)):
        raise JobError(f"--job {spec}: missing model_fn; a job defines model_fn() returning a tf_keras model")
    sources = [name for name in TRAIN_SOURCES if callable(getattr(target, name, None))]
    if len(sources) != 1:
        missing = " or ".join(TRAIN_SOURCES) if not sources else f"only one of {', '.join(sources)}"
        raise JobError(f"--job {spec}: missing {missing}; a job defines model_fn and one of {', '.join(TRAIN_SOURCES)}")
    parts = job_parts(spec, target)

    def optional(name: str):
        value = getattr(target, name, None)
        return value if callable(value) else None

    return Job(
        spec=spec,
        model_fn=target.model_fn,
        train_data=optional("train_data"),
        eval_data=optional("eval_data"),
        train_arrays=optional("train_arrays"),
        eval_arrays=optional("eval_arrays"),
        train_dataset=optional("train_dataset"),
        eval_dataset=optional("eval_dataset"),
        class_weight=checked_class_weight(spec, getattr(target, "class_weight", None)),
        **parts,
    )


def job_file(spec: str) -> str:
    """The source file of an imported job's module ("" when it is not imported): where its errors point."""
    import sys

    return getattr(sys.modules.get(spec.partition(":")[0]), "__file__", None) or ""


def checked_arrays(spec: str, what: str, data: Any) -> tuple:
    """Validate a data function's result: (features, labels) or (features, labels, sample_weights),
    each a NumPy array or a nest (dict, tuple, list) of arrays, all with the same number of rows."""
    if not (isinstance(data, tuple) and len(data) in (2, 3)):
        raise JobError(
            f"--job {spec}: {what}() must return (features, labels) or (features, labels, sample_weights); "
            "each an array or a dict/tuple of arrays"
        )
    import tensorflow as tf

    data = tuple(tf.nest.map_structure(lambda a: fixed_width(np.asarray(a), f"--job {spec}: {what}()"), part) for part in data)
    parts = ("features", "labels", "sample_weights")
    lengths = {
        f"{parts[i]}{'' if len(tf.nest.flatten(part)) == 1 else f'[{j}]'}": (len(a) if a.ndim else 0)
        for i, part in enumerate(data)
        for j, a in enumerate(tf.nest.flatten(part))
    }
    if len(set(lengths.values())) != 1 or 0 in lengths.values():
        shown = ", ".join(f"{name} {n}" for name, n in lengths.items())
        raise JobError(f"--job {spec}: {what}() returned {shown} rows; they must match and be non-empty")
    return data


def batches_of(example_shapes: list, example_of: list) -> bool:
    """Whether each of `example_shapes` (an example's feature shapes) is a batch of examples of the
    matching `example_of` shape: one leading dimension more, not of size 1 (Keras squeezes a trailing
    1 away: a column of shape [1] feeds an input of shape [])."""
    import tensorflow as tf

    return len(example_shapes) == len(example_of) > 0 and all(
        len(found) == len(of) + 1 and found[0] != 1 and tf.TensorShape(found[1:]).is_compatible_with(of)
        for found, of in zip(example_shapes, example_of, strict=True)
    )


def fixed_width(array: np.ndarray, what: str) -> np.ndarray:
    """`array` with text as fixed-width NumPy strings: an object array of `str` becomes `U`, of `bytes`
    `S` (what `.npy` files hold and the workers decode in-graph); other arrays are returned as they are."""
    if array.dtype != object:
        return array
    kinds = {type(x) for x in array.flat}
    if kinds <= {str} or kinds <= {bytes}:
        return array.astype(str if kinds <= {str} else bytes)
    found = ", ".join(sorted(k.__name__ for k in kinds))
    raise JobError(f"{what}: an object array holds {found}; give text as str (or bytes) and numbers as a numeric array")


def tensor_dtype(array: Any) -> Any:
    """The tf.DType of a NumPy array or tensor: tf.string for text (`U`, `S` or object arrays)."""
    import tensorflow as tf

    if isinstance(array, np.ndarray) and array.dtype.kind in "USO":
        return tf.string
    return tf.as_dtype(array.dtype)


def rows(nest: Any, index: Any) -> Any:
    """`array[index]` for every array of a nest (a slice, or an array of positions)."""
    import tensorflow as tf

    return tf.nest.map_structure(lambda a: a[index], nest)


def first_rows(features: Any, n: int = 1) -> Any:
    """The first `n` rows of every array of a features nest (a sample for building a model)."""
    return rows(features, slice(0, n))


def as_written(fn: Callable) -> Callable:
    """The job's callable `fn` (its model, a loss's `call`, its optimizer's `apply_gradients`, its
    `train_dataset`) run as inside an autograph=True `tf.function`: converted by AutoGraph (cached per
    function; Keras's own code is left as it is), with a subclassed layer's `call` and a `map` function
    converted where Keras and tf.data call them. pstrain traces its own functions with AutoGraph off
    (they use tf.while_loop and tf.cond directly, and converting them took about 2 s of every start-up);
    through this, a Python `if` on a tensor in the job's code still works as in Keras's `fit`."""
    import tensorflow as tf
    from tensorflow.python.autograph.core import ag_ctx

    def converted(*args, **kwargs):
        with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED):
            return tf.__internal__.autograph.tf_convert(fn, ag_ctx.control_status_ctx())(*args, **kwargs)

    return converted
