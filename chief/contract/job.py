"""The job contract: `Job`, `load_job` for `--job package.module[:attr]`, `JobError` (one of the one-line
errors of cluster/errors.py) and `job_file`. The checks on a job's arrays are in chief/contract/arrays.py; how
its code is run, in chief/contract/as_written.py; what a compiled model gives, in chief/contract/job_compiled.py."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chief.contract.job_compiled import job_parts
from cluster.errors import JobError

TRAIN_SOURCES = ("train_dataset", "train_arrays", "train_data")  # exactly one; see chief/data/train_source.py
OPTIONAL = ("eval_dataset", "eval_arrays", "eval_data", "metrics_fn", "loss_weights")


@dataclass(frozen=True)
class Job:
    spec: str
    model_fn: Callable[[], Any]
    loss_fn: Any  # a function (scalar or per-example losses), a Loss, a loss name, or a list/dict of those per output
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
    class_weight: dict[int, float] | None = None  # {label: weight}, as fit's class_weight (worker/replica/class_weights.py)
    callbacks_fn: Callable[[], list] | None = None  # fresh tf_keras callbacks, run on the chief (chief/callbacks.py)
    framework: str = "tf_keras"  # the job's Keras: "tf_keras" or "keras3" (chief/contract/framework.py)

    @property
    def name(self) -> str:
        return self.spec.replace(":", ".").rsplit(".", 1)[-1]


def load_job(spec: str) -> Job:
    """Import `package.module` or `package.module:attr` and check it offers the job API. What the job
    does not define (loss_fn, optimizer_fn, metrics_fn, loss_weights) is taken from the model's
    `compile()`, if `model_fn()` compiles it (chief/contract/job_compiled.py)."""
    from chief.contract.tf_settings import skipped_settings

    module_name, _, attr = spec.partition(":")
    try:
        with skipped_settings(spec):  # the chief joined the cluster: TF refuses settings now (tf_settings.py)
            target: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise JobError(f"--job {spec}: cannot import {module_name} ({e}); check the module path and PYTHONPATH") from None
    if attr:
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise JobError(f"--job {spec}: {module_name} has no attribute {attr!r}") from None
    if not callable(getattr(target, "model_fn", None)):
        raise JobError(f"--job {spec}: missing model_fn; a job defines model_fn() returning a Keras model (tf_keras or Keras 3)")
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
        callbacks_fn=optional("callbacks_fn"),
        **parts,
    )


def job_file(spec: str) -> str:
    """The source file of an imported job's module ("" when it is not imported): where its errors point."""
    import sys

    return getattr(sys.modules.get(spec.partition(":")[0]), "__file__", None) or ""


def checked_class_weight(spec: str, value: Any) -> dict[int, float] | None:
    """The job's `class_weight` as Keras requires it (None: none); a JobError in one line otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise JobError(f"--job {spec}: class_weight must be a dict {{label: weight}} (as fit's class_weight), found {value!r}")
    try:
        keys = sorted(int(k) for k in value if int(k) == k)
        weights = {int(k): float(w) for k, w in value.items()}
    except (TypeError, ValueError):
        raise JobError(f"--job {spec}: class_weight must map integer labels to numbers, found {value!r}") from None
    if keys != list(range(len(value))):
        raise JobError(
            f"--job {spec}: class_weight needs the labels 0 to {len(value) - 1} as keys (as fit's class_weight), "
            f"found {sorted(value)}"
        )
    return weights
