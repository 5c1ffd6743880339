"""A job's loss, loss weights, optimizer and metrics: its own functions, else what `compile()` set.

`model_fn()` may return a model on which `compile(optimizer=..., loss=..., loss_weights=...,
metrics=..., weighted_metrics=...)` was called. The model is built once here, with no initializer
run (no memory for its values), to read them; what the job defines itself takes precedence. The
chief builds its models more than once (training state, checkpoint mirror, each check), so nothing
compile made is shared: the optimizer is recreated from its class and config for every build, the
metrics are cloned for every evaluation. A model whose class overrides Keras's step methods is refused:
pstrain runs its own step and evaluation, so the override would be silently skipped.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

from chief.contract.framework import (
    KERAS3,
    NAMES,
    TF_KERAS,
    check_keras3_loss,
    clone_metrics,
    compiled_parts,
    framework_of_parts,
    get_loss,
    is_optimizer,
    refuse_keras3_features,
)
from cluster.errors import JobError

LOSS_FORMS = "a function, a tf_keras.losses.Loss or keras.losses.Loss, a loss name, or a list/dict of those per output"


def _found(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}" if not hasattr(value, "__dict__") else f"a {type(value).__name__} object"


def _leaves(value: Any) -> list:
    """The entries of a per-output list or dict, or [value]."""
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, list | tuple) else [value]


def check_loss(what: str, loss: Any, framework: str = TF_KERAS) -> None:
    """Raise JobError unless `loss` is a form pstrain (and the framework's compile) takes."""
    leaves = _leaves(loss)
    for leaf in leaves:
        if leaf is None and len(leaves) > 1:
            continue  # no loss for that output
        if isinstance(leaf, str):
            try:
                get_loss(framework, leaf)
            except ValueError:
                raise JobError(f"{what}: unknown loss name {leaf!r}; give {LOSS_FORMS}") from None
        elif not callable(leaf):
            raise JobError(f"{what}: found {_found(leaf)}; give {LOSS_FORMS}")
        check_keras3_loss(what, leaf)


def check_loss_weights(what: str, weights: Any) -> None:
    leaves = (
        list(weights.values()) if isinstance(weights, dict) else list(weights) if isinstance(weights, list | tuple) else [weights]
    )
    for leaf in leaves:
        if isinstance(leaf, bool) or not isinstance(leaf, int | float):
            raise JobError(f"{what}: found {_found(leaf)}; give a number, or a list/dict of numbers per output")


def fresh_optimizer_fn(optimizer: Any) -> Callable[[], Any]:
    """A function making a new optimizer like `optimizer` (its class and config) at every call."""
    cls, config = type(optimizer), optimizer.get_config()
    return lambda: cls.from_config(copy.deepcopy(config))


def checked_optimizer_fn(spec: str, optimizer_fn: Callable[[], Any], optimizer: Any, framework: str) -> Callable[[], Any]:
    """`optimizer_fn`, after checking that `optimizer` (one it returned) is an optimizer of the framework."""
    if not is_optimizer(framework, optimizer):
        forms = "keras.optimizers.*" if framework == KERAS3 else "tf_keras.optimizers.* or tf_keras.optimizers.legacy.*"
        returned = _found(optimizer)
        raise JobError(f"--job {spec}: optimizer_fn() returned {returned}; return a {NAMES[framework]} optimizer ({forms})")
    if optimizer_fn() is optimizer:  # the training state, the checkpoint mirror and each check need their own
        raise JobError(f"--job {spec}: optimizer_fn() returns the same optimizer at each call; create a new one in it")
    return optimizer_fn


# Keras's step methods, which `fit` and `evaluate` call and pstrain does not: it computes the loss
# (worker/replica/losses.py, plus `model.losses`), applies the gradients and evaluates itself.
STEP_METHODS = ("train_step", "compute_loss", "test_step", "compute_metrics")


def built_model(model_fn: Callable[[], Any]) -> Any:
    """`model_fn()`, with no initializer run (no memory for its values)."""
    from chief.state.unfilled import unfilled_initializers

    with unfilled_initializers():
        return model_fn()


def refuse_custom_steps(spec: str, model: Any, framework: str) -> None:
    """Raise JobError if the model's class overrides one of Keras's `STEP_METHODS`: pstrain would
    train and evaluate without it, a model other than the one the job describes."""
    if framework == KERAS3:
        import keras

        base = keras.Model
    else:
        import tf_keras

        base = tf_keras.Model
    if not isinstance(model, base):
        return
    cls = type(model)
    found = [name for name in STEP_METHODS if getattr(cls, name, None) is not getattr(base, name)]
    if found:
        raise JobError(
            f"--job {spec}: model_fn()'s {cls.__name__} overrides {' and '.join(found)}, which pstrain does not run "
            "(it runs its own synchronous step); put extra loss terms in loss_fn or self.add_loss() in call(), "
            "extra metrics in metrics_fn"
        )


def takes_no_arguments(value: Any) -> bool:
    """A plain function (not a Loss object, not a name) that must be called without arguments."""
    if not (inspect.isfunction(value) or inspect.ismethod(value)):
        return False
    try:
        parameters = inspect.signature(value).parameters.values()
    except (TypeError, ValueError):
        return False
    return not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)


def job_parts(spec: str, target: Any) -> dict[str, Any]:
    """loss_fn, loss_weights, loss_name, optimizer_fn, metrics_fn, compiled_metrics and framework for a Job."""
    loss_fn, optimizer_fn = getattr(target, "loss_fn", None), getattr(target, "optimizer_fn", None)
    metrics_fn, loss_weights = getattr(target, "metrics_fn", None), getattr(target, "loss_weights", None)
    for name, value, returns in (("optimizer_fn", optimizer_fn, "optimizer"), ("metrics_fn", metrics_fn, "list of metrics")):
        if value is not None and not callable(value):
            raise JobError(f"--job {spec}: {name}: found {_found(value)}; define a function returning a fresh {returns}")
    model = built_model(target.model_fn)
    compiled = compiled_parts(model)
    parts: dict[str, Any] = {"loss_name": "loss_fn", "compiled_metrics": None, "metrics_fn": metrics_fn}
    if loss_fn is None and compiled is not None and compiled["loss"] is not None:
        loss_fn = compiled["loss"]
        parts["loss_name"] = "model_fn's compile(loss=...)"
        if loss_weights is None:
            loss_weights = compiled["loss_weights"]
    if optimizer_fn is None and compiled is not None and compiled["optimizer"] is not None:
        optimizer_fn = fresh_optimizer_fn(compiled["optimizer"])
    missing = [name for name, value in (("loss_fn", loss_fn), ("optimizer_fn", optimizer_fn)) if value is None]
    if missing:
        raise JobError(
            f"--job {spec}: missing {' and '.join(missing)}; define {', '.join(missing)} in the job, or compile the "
            "model returned by model_fn() (model.compile(optimizer=..., loss=...))"
        )
    if takes_no_arguments(loss_fn):  # a factory, as optimizer_fn is: `def loss_fn(): return BinaryCrossentropy()`
        loss_fn, parts["loss_name"] = loss_fn(), "loss_fn()"
    optimizer = optimizer_fn()
    uses: dict[str, Any] = {"optimizer_fn()'s optimizer": optimizer, parts["loss_name"]: loss_fn}
    if metrics_fn is not None:
        uses["metrics_fn()'s metrics"] = metrics_fn()
    elif compiled is not None:
        uses["compile(metrics=...)"] = [compiled["metrics"], compiled["weighted_metrics"]]
    framework = framework_of_parts(spec, model, uses)
    refuse_custom_steps(spec, model, framework)
    if framework == KERAS3:
        refuse_keras3_features(spec, model, optimizer)
        from chief.contract.keras3_lookup import route_lookups  # TensorFlow: not on a refused launch's path

        route_lookups()  # its Embedding gathers on the ps, not after a read of the whole table
    check_loss(f"--job {spec}: {parts['loss_name']}", loss_fn, framework)
    if loss_weights is not None:
        check_loss_weights(f"--job {spec}: loss_weights", loss_weights)
    if metrics_fn is None and compiled is not None and (compiled["metrics"] or compiled["weighted_metrics"]):
        metrics, weighted = compiled["metrics"], compiled["weighted_metrics"]
        parts["compiled_metrics"] = lambda: (clone_metrics(framework, metrics), clone_metrics(framework, weighted))
    return {
        **parts,
        "loss_fn": loss_fn,
        "loss_weights": loss_weights,
        "optimizer_fn": checked_optimizer_fn(spec, optimizer_fn, optimizer, framework),
        "framework": framework,
    }
