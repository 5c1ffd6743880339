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

from cluster.errors import JobError

LOSS_FORMS = "a function, a tf_keras.losses.Loss, a loss name, or a list/dict of those per output"


def _found(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}" if not hasattr(value, "__dict__") else f"a {type(value).__name__} object"


def _leaves(value: Any) -> list:
    """The entries of a per-output list or dict, or [value]."""
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, list | tuple) else [value]


def check_loss(what: str, loss: Any) -> None:
    """Raise JobError unless `loss` is a form pstrain (and compile) takes."""
    import tf_keras

    leaves = _leaves(loss)
    for leaf in leaves:
        if leaf is None and len(leaves) > 1:
            continue  # no loss for that output
        if isinstance(leaf, str):
            try:
                tf_keras.losses.get(leaf)
            except ValueError:
                raise JobError(f"{what}: unknown loss name {leaf!r}; give {LOSS_FORMS}") from None
        elif not callable(leaf):
            raise JobError(f"{what}: found {_found(leaf)}; give {LOSS_FORMS}")


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


def checked_optimizer_fn(spec: str, optimizer_fn: Callable[[], Any]) -> Callable[[], Any]:
    """`optimizer_fn`, after checking (once) that it returns a tf_keras optimizer."""
    import tf_keras

    optimizer = optimizer_fn()
    if not isinstance(optimizer, tf_keras.optimizers.Optimizer | tf_keras.optimizers.legacy.Optimizer):
        raise JobError(
            f"--job {spec}: optimizer_fn() returned {_found(optimizer)}; return a tf_keras optimizer "
            "(tf_keras.optimizers.* or tf_keras.optimizers.legacy.*)"
        )
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


def refuse_custom_steps(spec: str, model: Any) -> None:
    """Raise JobError if the model's class overrides one of Keras's `STEP_METHODS`: pstrain would
    train and evaluate without it, a model other than the one the job describes."""
    import tf_keras

    if not isinstance(model, tf_keras.Model):
        return
    cls = type(model)
    found = [name for name in STEP_METHODS if getattr(cls, name, None) is not getattr(tf_keras.Model, name)]
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
    """loss_fn, loss_weights, loss_name, optimizer_fn, metrics_fn and compiled_metrics for a Job."""
    from tf_keras.src.metrics import clone_metrics

    loss_fn, optimizer_fn = getattr(target, "loss_fn", None), getattr(target, "optimizer_fn", None)
    metrics_fn, loss_weights = getattr(target, "metrics_fn", None), getattr(target, "loss_weights", None)
    for name, value, returns in (("optimizer_fn", optimizer_fn, "optimizer"), ("metrics_fn", metrics_fn, "list of metrics")):
        if value is not None and not callable(value):
            raise JobError(f"--job {spec}: {name}: found {_found(value)}; define a function returning a fresh {returns}")
    model = built_model(target.model_fn)
    refuse_custom_steps(spec, model)
    compiled = model if getattr(model, "_is_compiled", False) else None
    parts: dict[str, Any] = {"loss_name": "loss_fn", "compiled_metrics": None, "metrics_fn": metrics_fn}
    if loss_fn is None and compiled is not None and compiled.compiled_loss is not None:
        loss_fn = compiled.compiled_loss._user_losses
        parts["loss_name"] = "model_fn's compile(loss=...)"
        if loss_weights is None:
            loss_weights = compiled.compiled_loss._user_loss_weights
    if optimizer_fn is None and compiled is not None:
        optimizer_fn = fresh_optimizer_fn(compiled.optimizer)
    missing = [name for name, value in (("loss_fn", loss_fn), ("optimizer_fn", optimizer_fn)) if value is None]
    if missing:
        raise JobError(
            f"--job {spec}: missing {' and '.join(missing)}; define {', '.join(missing)} in the job, or compile the "
            "model returned by model_fn() (model.compile(optimizer=..., loss=...))"
        )
    if takes_no_arguments(loss_fn):  # a factory, as optimizer_fn is: `def loss_fn(): return BinaryCrossentropy()`
        loss_fn, parts["loss_name"] = loss_fn(), "loss_fn()"
    check_loss(f"--job {spec}: {parts['loss_name']}", loss_fn)
    if loss_weights is not None:
        check_loss_weights(f"--job {spec}: loss_weights", loss_weights)
    if metrics_fn is None and compiled is not None and compiled.compiled_metrics is not None:
        metrics = compiled.compiled_metrics._user_metrics
        weighted = compiled.compiled_metrics._user_weighted_metrics
        parts["compiled_metrics"] = lambda: (clone_metrics(metrics), clone_metrics(weighted))
    return {**parts, "loss_fn": loss_fn, "loss_weights": loss_weights, "optimizer_fn": checked_optimizer_fn(spec, optimizer_fn)}
