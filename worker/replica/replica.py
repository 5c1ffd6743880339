"""One replica slot's share of a step, the same code in both engines, and the job's check before training.

`replica_step` runs the forward pass under per-(seed, step, slot) randomness with forward-pass
assignments captured, reduces the loss as Keras does (plus `model.losses`), and returns the slot's
loss, gradients and state deltas. `inspect_job` runs it once on the engine's model (nothing is
written to it) and inspects its graph, so a job that breaks the contract is refused with one line
before any step, in both engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras

from chief.contract.as_written import as_written
from chief.contract.framework import trainable_of, variables_of
from chief.contract.graph_ops import unsupported_ops
from chief.contract.job import Job, JobError
from cluster.config import TrainConfig
from worker.ps.clipping import refuse_whole_variable_features
from worker.replica.build_errors import building_from
from worker.replica.class_weights import class_weighted
from worker.replica.forward_state import capture_assigns, layer_of
from worker.replica.gradients import replica_gradients
from worker.replica.losses import slot_loss


def unpack(data: tuple) -> tuple[Any, Any, Any]:
    """(features, labels, sample_weights or None) from a data tuple of two or three nests."""
    return data[0], data[1], data[2] if len(data) > 2 else None


def gather(data: Any, indices) -> Any:
    """The rows `indices` of every array in a data nest (inside a traced function)."""
    return tf.nest.map_structure(lambda a: tf.gather(a, indices), data)


def is_loss_scaled(optimizer) -> bool:
    return isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer)


@dataclass(frozen=True)
class Replica:
    """What a slot's step needs: the job, the model, its optimizer and the state variables to capture."""

    job: Job
    model: tf_keras.Model
    optimizer: Any
    state_variables: tuple  # non-trainable variables the forward pass assigns
    seed: int
    num_slots: int  # gradients averaged into a step
    sparse: tuple[bool, ...] | None = None  # per trainable variable: row-sparse (worker/replica/gradients.py); None: all dense


def replica_step(
    r: Replica, data: tuple, step, slot, touched: list | None = None, reads: dict | None = None
) -> tuple[tf.Tensor, list, list]:
    """(loss, gradients, state deltas) of one slot; nothing is written to any variable. Gradients of
    row-sparse variables are deduplicated, sorted row slices, the others dense. `touched`, if
    given, receives the positions in `r.state_variables` that the forward pass assigned. `reads`:
    position among the trainable variables -> the tensor the model reads for it instead (a worker's
    copy, worker/replica/allreduce.py `reading`): its gradient is taken for that tensor, and a loss that
    also reads the variable itself raises JobError (one line: the hybrid could not keep it exact)."""
    from worker.replica.randomness import stateless_random

    features, labels, weights = unpack(data)
    if r.job.class_weight:  # as fit applies it: per-example weights by label, times any sample weights
        weights = class_weighted(r.job.class_weight, labels, weights)
    variables = trainable_of(r.model)
    with capture_assigns(r.state_variables) as captured, stateless_random(r.model, r.seed, step, slot):
        with tf.GradientTape() as tape, building_from(r.job, data):
            tape.watch(list((reads or {}).values()))
            predictions = as_written(r.model)(features, training=True)
            loss = slot_loss(r.job, getattr(r.model, "output_names", None), labels, predictions, weights, r.num_slots)
            if r.model.losses:  # regularizers and add_loss, once per step (the same in every slot)
                loss = loss + tf.add_n([tf.cast(x, tf.float32) for x in r.model.losses])
            scaled = r.optimizer.get_scaled_loss(loss) if is_loss_scaled(r.optimizer) else loss
        deltas = captured.deltas()
        if touched is not None:
            touched.extend(captured.touched)
    replaced = [variables[i] for i in reads or {}]  # read through `reads`: the loss may not read them
    grads = tape.gradient(scaled, [(reads or {}).get(i, v) for i, v in enumerate(variables)] + replaced)
    grads, elsewhere = grads[: len(variables)], grads[len(variables) :]
    if read := [v.name for v, g in zip(replaced, elsewhere, strict=True) if g is not None]:
        raise JobError(
            f"model_fn: the loss reads the variable {read[0]} other than through its layer (e.g. a loss added "
            'with a lambda that holds the variable), which train.dense = "allreduce" cannot replicate; '
            'read it as the layer\'s attribute (self.kernel), or set train.dense = "ps"'
        )
    if is_loss_scaled(r.optimizer):
        grads = r.optimizer.get_unscaled_gradients(grads)
    sparse = r.sparse if r.sparse is not None else (False,) * len(variables)
    return loss, replica_gradients(grads, variables, sparse), deltas


def assigned_state_variables(model: tf_keras.Model, positions: tuple[int, ...], shapes: tuple) -> tuple:
    """The model's non-trainable variables at `positions` (found by `inspect_job`, with their
    `shapes`); a state variable sharded across ps tasks is refused."""
    weights = variables_of(model.non_trainable_weights)
    found = tuple(weights[i] for i in positions if i < len(weights))
    if [tuple(v.shape) for v in found] != list(shapes) or any("/part_" in v.name for v in found):
        raise JobError(
            "model_fn: a non-trainable variable that the forward pass assigns is sharded across ps tasks "
            "(too large for one shard); use --ps 1, or keep such state under 256 KiB"
        )
    return found


def run_unwrapped(function, *args):
    """`function(*args)`; a JobError raised while tracing it (autograph wraps it in a StagingError) is
    raised as it is, so the user sees its one line."""
    try:
        return function(*args)
    except Exception as e:
        cause, seen = e, set()
        while cause is not None and not isinstance(cause, JobError) and id(cause) not in seen:
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        if not isinstance(cause, JobError):
            raise
        raise cause from None


def inspect_job(
    job: Job, train: TrainConfig, batch: tuple, model: tf_keras.Model, sparse: tuple[bool, ...] | None = None
) -> tuple[tuple[int, ...], tuple]:
    """Check the job on its first slot's `batch` with the engine's `model` at its initial weights
    (read where they live; nothing is written); returns the positions in `variables_of(model.non_trainable_weights)`
    of the variables its forward pass assigns, and their shapes. `sparse`: the row-sparse trainable
    variables (worker/replica/gradients.py), whose gradients stay row slices here too (a dense gradient of a
    table would be table-sized). Raises JobError (one line) for a contract the engines cannot keep."""
    optimizer = job.optimizer_fn()
    refuse_whole_variable_features(optimizer, trainable_of(model))
    candidates = tuple(variables_of(model.non_trainable_weights))
    replica = Replica(job, model, optimizer, candidates, train.seed, train.replicas_to_aggregate, sparse)
    # Functions, as in the closures: eagerly, a lookup of a table sharded over ps tasks reads all of it.
    output = run_unwrapped(tf.function(lambda features: as_written(model)(features, training=False), autograph=False), batch[0])
    for leaf in tf.nest.flatten(output):
        if leaf.dtype.is_floating and not np.all(np.isfinite(tf.cast(leaf, tf.float32).numpy())):
            raise JobError(
                f"model_fn: the model's output (shape {list(leaf.shape)}) on the first batch is not finite; "
                "check the input scaling and the layers (e.g. a log or division of raw features)"
            )
    found_touched: list[int] = []  # filled while tracing
    step = tf.function(lambda d: replica_step(replica, d, tf.constant(0, tf.int64), 0, touched=found_touched)[0], autograph=False)
    run_unwrapped(step, batch)
    touched = tuple(found_touched)
    for i in touched:
        if not candidates[i].dtype.is_floating:
            raise JobError(
                f"model_fn: the forward pass assigns the integer variable {candidates[i].name}; pstrain "
                "can average only floating-point state across replicas: make it float or compute it outside call()"
            )
    traced = Replica(
        job, model, optimizer, tuple(candidates[i] for i in touched), train.seed, train.replicas_to_aggregate, sparse
    )
    step = tf.function(lambda d: replica_step(traced, d, tf.constant(0, tf.int64), 0)[0], autograph=False)
    graph = step.get_concrete_function(batch).graph
    if adding := [layer.name for layer in model._flatten_layers() if getattr(layer, "_metrics", None)]:
        raise JobError(
            f"model_fn: layer {adding[-1]!r} calls self.add_metric() in call(), which pstrain does not take (the "
            "metric would be updated in each replica's forward pass); give the metric in metrics_fn() or compile(metrics=...)"
        )
    found = unsupported_ops(graph)
    if found:
        op, name = found[0]
        layer = layer_of(name, [layer.name for layer in model._flatten_layers(include_self=False)])
        kind = "a stateful random op" if "Random" in op or "Stateful" in op or "Rng" in op else "a variable write"
        raise JobError(
            f"model_fn: layer {layer!r} makes {kind} ({op}) in its forward pass that pstrain cannot make synchronous; "
            "use Keras's RandomGenerator (self._random_generator) for randomness and variable.assign*() for state"
        )
    return touched, tuple(tuple(candidates[i].shape) for i in touched)
