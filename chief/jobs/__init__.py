"""Jobs that ship with pstrain, and the loader for `--job package.module[:attr]`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.errors import ConfigError

REQUIRED = ("model_fn", "loss_fn", "optimizer_fn")
TRAIN_SOURCES = ("train_dataset", "train_arrays", "train_data")  # exactly one; see chief/sources.py


class JobError(ConfigError):
    """A job that cannot be used; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Job:
    spec: str
    model_fn: Callable[[], Any]
    loss_fn: Callable[[Any, Any], Any]
    optimizer_fn: Callable[[], Any]
    train_data: Callable[[], tuple[np.ndarray, np.ndarray]] | None
    eval_data: Callable[[], tuple[np.ndarray, np.ndarray]] | None
    train_arrays: Callable[[], Any] | None = None  # (features, labels) as paths of .npy files
    eval_arrays: Callable[[], Any] | None = None
    train_dataset: Callable[[], Any] | None = None  # a tf.data.Dataset of single (features, labels) examples
    eval_dataset: Callable[[], Any] | None = None

    @property
    def name(self) -> str:
        return self.spec.replace(":", ".").rsplit(".", 1)[-1]


def load_job(spec: str) -> Job:
    """Import `package.module` or `package.module:attr` and check it offers the job API."""
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
    missing = [name for name in REQUIRED if not callable(getattr(target, name, None))]
    sources = [name for name in TRAIN_SOURCES if callable(getattr(target, name, None))]
    if len(sources) != 1:
        missing.append(" or ".join(TRAIN_SOURCES) if not sources else f"only one of {', '.join(sources)}")
    if missing:
        raise JobError(
            f"--job {spec}: missing {', '.join(missing)}; a job defines {', '.join(REQUIRED)} and one of "
            f"{', '.join(TRAIN_SOURCES)} (eval_* optional)"
        )

    def optional(name: str):
        value = getattr(target, name, None)
        return value if callable(value) else None

    return Job(
        spec=spec,
        model_fn=target.model_fn,
        loss_fn=target.loss_fn,
        optimizer_fn=target.optimizer_fn,
        train_data=optional("train_data"),
        eval_data=optional("eval_data"),
        train_arrays=optional("train_arrays"),
        eval_arrays=optional("eval_arrays"),
        train_dataset=optional("train_dataset"),
        eval_dataset=optional("eval_dataset"),
    )


def checked_arrays(spec: str, what: str, data: Any) -> tuple[Any, Any]:
    """(features, labels), each an array or a nest (dicts, tuples) of arrays, all with the same non-zero length."""
    import tensorflow as tf

    if not (isinstance(data, tuple) and len(data) == 2):
        raise JobError(f"--job {spec}: {what}() must return (features, labels): arrays or nests (dicts, tuples) of arrays")
    data = tf.nest.map_structure(np.asarray, data)
    lengths = {leaf.shape[0] if leaf.ndim else 0 for leaf in tf.nest.flatten(data)}
    if len(lengths) != 1 or 0 in lengths:
        raise JobError(
            f"--job {spec}: {what}() returned arrays of {sorted(lengths)} examples; "
            "features and labels must match and be non-empty"
        )
    return data
