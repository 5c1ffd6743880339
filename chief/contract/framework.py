"""The job's framework: tf_keras (what `tf.keras` is in pstrain's tasks, which run with
TF_USE_LEGACY_KERAS=1) or Keras 3 (`import keras`, TensorFlow backend), and what differs between them.

Both build the same TensorFlow variables, so pstrain's step, aggregator and checkpoints work on
`tf.Variable`s whatever the framework (`tf_variable`); what each framework does its own way (its
compile arguments, loss and metric objects, the optimizer's apply, its seeding) is here, so the
rest of pstrain has one path. A job uses one framework throughout: a model from one and an
optimizer, loss or metric object from the other is refused (`framework_of_parts`), as are the
Keras 3 features pstrain cannot make exact (`refuse_keras3_features`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from cluster.errors import JobError

TF_KERAS, KERAS3 = "tf_keras", "keras3"
NAMES = {TF_KERAS: "tf_keras", KERAS3: "Keras 3"}
MODULES = {TF_KERAS: "tf_keras (tf.keras in pstrain's tasks)", KERAS3: "keras (import keras)"}
# Keras 3 loss reductions pstrain splits over replica slots exactly (each a mean over the loss
# values, or their sum); "mean_with_sample_weight" divides by a global sum of weights, "none" is no scalar.
KERAS3_REDUCTIONS = ("sum_over_batch_size", "mean", "sum")


def framework_of(obj: Any) -> str | None:
    """TF_KERAS or KERAS3 for an object of either (an instance of one of its classes, or a subclass
    of one), None for anything else (a name, a plain function, a number)."""
    for cls in type(obj).__mro__:
        root = cls.__module__.split(".", 1)[0]
        if root == "tf_keras":
            return TF_KERAS
        if root == "keras":
            return KERAS3
    return None


def _keras3():
    import keras

    return keras


def _described(obj: Any) -> str:
    return f"{NAMES[framework_of(obj)]} {type(obj).__name__}"


def framework_of_parts(spec: str, model: Any, parts: dict[str, Any]) -> str:
    """The model's framework, after checking that every object in `parts` ({what: object or nest})
    is of the same one; a JobError naming both otherwise."""
    framework = framework_of(model) or TF_KERAS
    for what, value in parts.items():
        for leaf in _leaves(value):
            other = framework_of(leaf)
            if other is not None and other != framework:
                raise JobError(
                    f"--job {spec}: model_fn() returns a {_described(model)} model but {what} is a {_described(leaf)}; "
                    f"use one Keras throughout: {MODULES[framework]} for the model, its optimizer, losses and metrics"
                )
    return framework


def _leaves(value: Any) -> list:
    """The entries of a nest of lists, tuples and dicts (per-output losses, metrics)."""
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def tf_variable(variable: Any) -> Any:
    """The `tf.Variable` behind a Keras 3 variable (on a cluster, the one on its ps); any other
    variable as it is."""
    if framework_of(variable) == KERAS3:
        return variable.value
    return variable


def sharded_value(variable: Any) -> Any:
    """The `ShardedVariable` a Keras 3 variable wraps on several ps; None for any other variable."""
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    value = getattr(variable, "value", None) if framework_of(variable) == KERAS3 else None
    return value if isinstance(value, ShardedVariable) else None


def shards_of(variables: list) -> list:
    """`variables` with each split Keras 3 variable replaced by its shards (in row order)."""
    return [shard for v in variables for shard in (sharded_value(v).variables if sharded_value(v) is not None else [v])]


def variables_of(weights: Any) -> list[Any]:
    """The `tf.Variable`s among a model's `weights` (or `trainable_variables`, `non_trainable_weights`,
    an optimizer's `variables`): a lookup layer adapted to its data also lists its vocabulary there, a
    weight handler that is no variable (every copy of the model adapts it on the same data:
    chief/state/adapted.py); a Keras 3 variable stands for the `tf.Variable` it wraps, or for its shards
    when split over ps tasks (chief/state/keras3_shards.py), as tf_keras lists a split variable."""
    from tf_keras.src.engine.base_layer_utils import TrackableWeightHandler

    return [tf_variable(w) for w in shards_of(weights) if not isinstance(w, TrackableWeightHandler)]


def trainable_of(model: Any) -> list[Any]:
    """The model's trainable `tf.Variable`s, in Keras's order: what gradients are taken for and pushed."""
    return variables_of(model.trainable_variables)


def compiled_parts(model: Any) -> dict[str, Any] | None:
    """What `model.compile(...)` set, as {optimizer, loss, loss_weights, metrics, weighted_metrics}
    (None where not given); None when the model was not compiled."""
    if framework_of(model) == KERAS3:
        if not getattr(model, "compiled", False):
            return None
        config = model._compile_config.config  # compile's arguments as given
        return {
            "optimizer": model.optimizer,
            "loss": config.get("loss"),
            "loss_weights": config.get("loss_weights"),
            "metrics": config.get("metrics"),
            "weighted_metrics": config.get("weighted_metrics"),
        }
    if not getattr(model, "_is_compiled", False):
        return None
    loss = model.compiled_loss
    metrics = model.compiled_metrics
    return {
        "optimizer": model.optimizer,
        "loss": None if loss is None else loss._user_losses,
        "loss_weights": None if loss is None else loss._user_loss_weights,
        "metrics": None if metrics is None else metrics._user_metrics,
        "weighted_metrics": None if metrics is None else metrics._user_weighted_metrics,
    }


def clone_metrics(framework: str, metrics: Any) -> Any:
    """Fresh copies of compile's `metrics` (a list or dict of names, functions and metric objects)."""
    if framework == KERAS3:
        import keras

        def clone(m):
            return m.__class__.from_config(m.get_config()) if isinstance(m, keras.metrics.Metric) else m

        if metrics is None:
            return None
        if isinstance(metrics, dict):
            return {k: [clone(m) for m in v] if isinstance(v, list | tuple) else clone(v) for k, v in metrics.items()}
        return [[clone(m) for m in v] if isinstance(v, list | tuple) else clone(v) for v in metrics]
    from tf_keras.src.metrics import clone_metrics as tf_keras_clone

    return tf_keras_clone(metrics)


def is_optimizer(framework: str, optimizer: Any) -> bool:
    if framework == KERAS3:
        return isinstance(optimizer, _keras3().optimizers.Optimizer)
    import tf_keras

    return isinstance(optimizer, tf_keras.optimizers.Optimizer | tf_keras.optimizers.legacy.Optimizer)


def get_loss(framework: str, loss: Any) -> Any:
    """A loss name or object resolved as the framework's `compile` resolves it (ValueError: unknown name)."""
    if framework == KERAS3:
        found = _keras3().losses.get(loss)
        if found is None:
            raise ValueError(f"unknown loss {loss!r}")
        return found
    import tf_keras

    return tf_keras.losses.get(loss)


def check_keras3_loss(what: str, loss: Any) -> None:
    """Raise JobError for a Keras 3 `Loss` whose reduction pstrain cannot split over slots exactly."""
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    if framework_of(loss) == KERAS3 and hasattr(loss, "call") and reduction not in KERAS3_REDUCTIONS:
        raise JobError(
            f"{what}: a Keras 3 {type(loss).__name__} with reduction={reduction!r} is not supported; "
            f"use one of {', '.join(repr(r) for r in KERAS3_REDUCTIONS)} (the default is 'sum_over_batch_size')"
        )


class Keras3Loss:
    """A Keras 3 `Loss` as pstrain's losses (worker/replica/losses.py) use one: `call` gives per-example
    values (the labels and predictions first converted to the loss's dtype, as its `__call__` does),
    `reduction` is "sum" or a mean over the values."""

    def __init__(self, loss: Any):
        self.loss = loss
        self.reduction = "sum" if loss.reduction == "sum" else "sum_over_batch_size"

    def call(self, y_true, y_pred):
        import tensorflow as tf

        dtype = tf.as_dtype(self.loss.dtype)
        return self.loss.call(tf.cast(y_true, dtype), tf.cast(y_pred, dtype))


def loss_object(framework: str, loss: Any) -> Any:
    """An object with `call(y_true, y_pred)` (per-example values) and `reduction`, for one output's
    loss (a name, a function or a `Loss` of the job's framework), as `compile` makes it."""
    if framework == KERAS3:
        from keras.src.losses.losses import LossFunctionWrapper as Keras3Wrapper

        loss = get_loss(KERAS3, loss)
        return Keras3Loss(loss if isinstance(loss, _keras3().losses.Loss) else Keras3Wrapper(loss))
    import tf_keras
    from tf_keras.src.losses import LossFunctionWrapper

    loss = tf_keras.losses.get(loss)
    return loss if isinstance(loss, tf_keras.losses.Loss) else LossFunctionWrapper(loss)


class EvalMetrics:
    """Fresh metrics for one evaluation, matched to the outputs as the framework's `compile` matches
    them: `update_state(labels, predictions, sample_weight)`, then `results()` by Keras's names."""

    def __init__(self, framework: str, metrics: Any, weighted: Any, output_names):
        self.framework = framework
        if framework == KERAS3:
            from keras.src.trainers.compile_utils import CompileMetrics

            self.container = CompileMetrics(metrics, weighted, output_names=output_names)
        else:
            from tf_keras.src.engine import compile_utils

            self.container = compile_utils.MetricsContainer(metrics, weighted, output_names=output_names)
        self.updated = False

    def update_state(self, labels, predictions, sample_weight=None) -> None:
        self.container.update_state(labels, predictions, sample_weight=sample_weight)
        self.updated = True

    def results(self) -> dict[str, float]:
        if not self.updated:
            return {}
        if self.framework == KERAS3:
            return {name: float(value) for name, value in self.container.result().items()}
        return {metric.name: float(metric.result()) for metric in self.container.metrics}


def apply_gradients(optimizer: Any, grads: list, variables: list) -> None:
    """`optimizer.apply_gradients` of the step's mean `grads` to `variables` (`tf.Variable`s, as
    `tf_variable` gives them). A Keras 3 optimizer updates the Keras variables it was built on (their
    constraints apply); tf_keras's is told the gradients are already aggregated across replicas."""
    from chief.contract.as_written import as_written

    if framework_of(optimizer) == KERAS3:
        keras_variables = {id(tf_variable(v)): v for v in optimizer._trainable_variables}
        pairs = [(shaped(g, v), keras_variables[id(v)]) for g, v in zip(grads, variables, strict=True)]
        as_written(optimizer.apply_gradients)(pairs)
        return
    as_written(optimizer.apply_gradients)(zip(grads, variables, strict=True), experimental_aggregate_gradients=False)


def shaped(gradient: Any, variable: Any) -> Any:
    """`gradient` with its variable's static shape: a mean taken from the ps's accumulators has none, and
    Keras 3's ops read the shape while tracing (`keras.ops.add` calls `shape.as_list()`, so RMSprop, say,
    failed on the cluster). `ensure_shape` changes no value; a row-sparse gradient keeps its rows."""
    import tensorflow as tf

    if isinstance(gradient, tf.IndexedSlices):
        values = tf.ensure_shape(gradient.values, [None, *variable.shape[1:]])
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return tf.ensure_shape(gradient, variable.shape)


def learning_rate_schedule(optimizer: Any) -> Callable[[int], float] | None:
    """step -> a Keras 3 optimizer's scheduled learning rate; None for a fixed rate or tf_keras."""
    schedule = getattr(optimizer, "_learning_rate", None)
    if framework_of(optimizer) == KERAS3 and isinstance(schedule, _keras3().optimizers.schedules.LearningRateSchedule):
        return lambda step: float(schedule(step))
    return None


def keras3_seed_generators(model: Any) -> list[tuple[int, int, Any]]:
    """(layer position, index in the layer, generator) for every Keras 3 `keras.random.SeedGenerator` of
    `model`'s layers (Dropout's, GaussianNoise's, ...); none for a tf_keras model."""
    return [
        (position, index, generator)
        for position, layer in enumerate(model._flatten_layers(include_self=False))
        for index, generator in enumerate(getattr(layer, "_seed_generators", None) or [])
    ]


def seed_states(model: Any) -> list[Any]:
    """The state variables of the model's Keras 3 seed generators: not among its weights, but in its checkpoint."""
    return [tf_variable(generator.state) for _, _, generator in keras3_seed_generators(model)]


def seed_keras3(seed: int) -> None:
    """Seed Keras 3 as `keras.utils.set_random_seed` does (its global SeedGenerator too), when a job
    imported it: its initializers draw their seeds from Python's `random`, which tf_keras seeds too."""
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "utils"):
        keras.utils.set_random_seed(seed)


def refuse_keras3_features(spec: str, model: Any, optimizer: Any) -> None:
    """Raise JobError (one line, naming the feature and what to use instead) for what pstrain cannot
    train exactly on Keras 3 yet: mixed_float16 (loss scaling), and the optimizer's own loss scaling
    or gradient accumulation."""
    for layer in model._flatten_layers(include_self=True):
        policy = getattr(layer, "dtype_policy", None)
        if getattr(policy, "compute_dtype", None) == "float16":
            raise JobError(
                f"--job {spec}: Keras 3 layer {layer.name!r} computes in float16 (mixed_float16), which needs "
                "loss scaling pstrain does not do for Keras 3; use mixed_bfloat16, float32, or tf_keras's mixed_float16"
            )
    if type(optimizer).__name__ == "LossScaleOptimizer":
        raise JobError(
            f"--job {spec}: optimizer_fn: a Keras 3 LossScaleOptimizer is not supported; use the optimizer it wraps "
            "(with mixed_bfloat16 or float32), or tf_keras"
        )
    instead = {
        "gradient_accumulation_steps": "pstrain applies every step's gradients; raise --global-batch-size instead",
        "loss_scale_factor": "pstrain does not scale Keras 3 losses; remove it",
    }
    for name, fix in instead.items():
        if getattr(optimizer, name, None):
            value = getattr(optimizer, name)
            raise JobError(f"--job {spec}: optimizer_fn: a Keras 3 optimizer's {name}={value} is not supported ({fix})")
