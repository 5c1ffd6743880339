"""The hybrid step's chief side (train.dense = "allreduce"): what it refuses, and the workers' copies.

The model's variables stay where the "ps" mode puts them (on the ps), and so do the optimizer's: they
are the one copy that checkpoints, evaluations and the export read. With "allreduce" each worker also
holds its own copy of the dense (not row-sparse) trainable variables and of their optimizer's slots
and step count (worker/replica/allreduce.py `WorkerCopy`, made from the ps's values, so a run resumes
from any checkpoint), updates them itself with the step's exchanged mean, and after each block one
worker writes its copies back to the ps (all copies are equal bit for bit). The tables keep their
row-sparse pushes and their update on the ps.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import tensorflow as tf
import tf_keras

from chief.contract.framework import TF_KERAS, trainable_of
from chief.contract.job import Job
from chief.state.model_state import create_optimizer_slots
from cluster.config import TrainConfig
from cluster.errors import EXIT_RESTARTABLE, ConfigError
from worker.ps.clipping import clipping_of
from worker.replica.allreduce import WorkerCopy, places
from worker.replica.replica import Replica

FIX = 'set train.dense = "ps"'  # every refusal's way out; where the line names another, "..., or {FIX}"
COPIES_PAST = "dense copies past its step"  # in the re-run check's message (DenseCopies.check_step)
COPIES_ELSEWHERE = "dense copies not at the step the ps applied"  # in the write-back's (DenseCopies.write_back)
# What TF says in a survivor once a worker of the collective group was lost (../shared/notes/hybrid.md).
COLLECTIVES_LOST = ("Collective ops is aborted", "expects a different device incarnation", "Collective has timed out")
# The chief's wait for a block never stops ticking; when it has not ticked this long, TF's recovery of a
# lost worker holds the chief (seen once: its collectives' partner gone, the coordinator re-ran closures
# without end while the chief's reads of the ps waited): the run ends rather than hang.
WATCHDOG_S = 180.0
KINDS = (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer)
LAZY_ADAM = ("chief.optimizers", "LazyAdam")  # taken by name: chief/step may not import chief.optimizers (tests/test_imports.py)


def refusal(job: Job, train: TrainConfig, replica: Replica, workers: int) -> str | None:
    """Why this run cannot take the hybrid step exactly (one line naming the setting and the fix), or None."""
    dense = [v for v, rows in zip(trainable_of(replica.model), replica.sparse, strict=True) if not rows]
    optimizer = replica.optimizer
    if train.total_num_replicas != train.replicas_to_aggregate:
        return (
            'train.dense = "allreduce" does not take backup workers yet: set train.total_num_replicas = '
            f"replicas_to_aggregate, or {FIX}"
        )
    if train.replicas_to_aggregate != workers:
        return (
            f'train.dense = "allreduce" needs one slot per worker: set train.replicas_to_aggregate = {workers} '
            f"(the workers) or use {train.replicas_to_aggregate} workers, or {FIX}"
        )
    if train.on_nonfinite != "stop":
        return f'train.dense = "allreduce" keeps only train.on_nonfinite = "stop": set it, or {FIX}'
    if job.framework != TF_KERAS:
        return f'train.dense = "allreduce" takes tf_keras models only (the job uses Keras 3): {FIX}'
    if not dense:
        return f'train.dense = "allreduce": the model has no dense trainable variable to replicate; {FIX}'
    if sharded := [v.name for v in dense if "/part_" in v.name]:
        return f'train.dense = "allreduce": the dense variable {sharded[0]} is sharded across ps tasks; use --ps 1, or {FIX}'
    if replica.state_variables:
        return f'train.dense = "allreduce" does not keep forward-pass state (BatchNormalization) yet: {FIX}'
    if isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer):
        return f'train.dense = "allreduce" does not take a loss-scaled optimizer (mixed_float16) yet: {FIX}'
    if mixed := mixed_policy(replica.model):
        return f'train.dense = "allreduce" does not take a mixed-precision policy ({mixed}) yet: {FIX}'
    if not isinstance(optimizer, KINDS):
        return f'train.dense = "allreduce" takes tf_keras optimizers only (not Keras 3 ones): {FIX}'
    kind = type(optimizer)
    if kind.__module__.split(".")[0] != "tf_keras" and (kind.__module__, kind.__name__) != LAZY_ADAM:
        return (
            f'train.dense = "allreduce" takes tf_keras\'s own optimizers and LazyAdam, not a subclass '
            f"({kind.__name__}: the copies' update would bypass what it overrides): {FIX}"
        )
    if isinstance(optimizer, tf_keras.optimizers.Nadam | tf_keras.optimizers.legacy.Nadam):
        return f'train.dense = "allreduce" does not take Nadam (its momentum product is no slot the copies keep): {FIX}'
    if clipping_of(optimizer).steps() or getattr(optimizer, "weight_decay", None) or getattr(optimizer, "use_ema", False):
        return f'train.dense = "allreduce" does not take clipping, weight_decay or use_ema yet: {FIX}'
    if getattr(optimizer, "gradient_transformers", None):
        return f'train.dense = "allreduce" does not take a legacy optimizer\'s gradient_transformers: {FIX}'
    try:
        places(replica.model, dense)
    except ValueError as e:
        return f'train.dense = "allreduce": no layer holds {e} as an attribute (it cannot be replicated); {FIX}'
    return None


def mixed_policy(model) -> str | None:
    """The name of the first mixed-precision dtype policy among the model's layers (compute dtype other
    than the variables'), or None: the workers' copies are read as plain tensors, which Keras would not
    cast to the compute dtype as it casts the variables."""
    for layer in model._flatten_layers(include_self=True):
        policy = layer.dtype_policy
        if policy.compute_dtype != policy.variable_dtype:
            return policy.name
    return None


def refuse(job: Job, train: TrainConfig, replica: Replica, workers: int) -> None:
    """Raise ConfigError (one line) if `refusal` finds a reason."""
    if (why := refusal(job, train, replica, workers)) is not None:
        raise ConfigError(why)


def slot_lists(optimizer) -> list:
    """A new-style optimizer's per-variable slot lists (e.g. Adam's m and v), in a fixed order."""
    count = len(optimizer._index_dict)
    return [
        value
        for name, value in sorted(vars(optimizer).items())
        if not name.startswith("_self_")
        and name != "_variables"
        and isinstance(value, list | tuple)
        and len(value) == count
        and all(isinstance(v, tf.Variable) for v in value)
    ]


def slot_count(optimizer) -> int:
    """A built optimizer's slot variables per variable (Adam's 2; SGD without momentum's 0)."""
    if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
        return len(optimizer.get_slot_names())
    return len(slot_lists(optimizer))


def slot_pairs(ours, theirs, copies: Sequence[tf.Variable], originals: Sequence[tf.Variable], positions: Sequence[int]) -> list:
    """(our slot, their slot) for every slot of every copied variable: `ours` is the copies' optimizer,
    `theirs` the ps's over all trainable variables (`positions`: the copies' indices among them)."""
    if isinstance(theirs, tf_keras.optimizers.legacy.Optimizer):
        return [
            (ours.get_slot(copy, name), theirs.get_slot(original, name))
            for name in theirs.get_slot_names()
            for copy, original in zip(copies, originals, strict=True)
        ]
    pairs = []
    for j, position in enumerate(positions):
        pairs += [(mine[j], other[position]) for mine, other in zip(slot_lists(ours), slot_lists(theirs), strict=True)]
    return pairs


def share_hyperparameters(ours, theirs) -> None:
    """Make `ours` read `theirs`'s learning rate (a legacy optimizer's: every hyperparameter variable),
    so a callback that sets them on the chief's optimizer (LearningRateScheduler, ReduceLROnPlateau)
    sets them for the copies' updates too. Before `ours` creates its slots."""
    if isinstance(theirs, tf_keras.optimizers.legacy.Optimizer):
        for name, value in theirs._hyper.items():
            if isinstance(value, tf.Variable):
                ours._hyper[name] = value
    elif isinstance(theirs._learning_rate, tf.Variable):  # else a schedule of the (paired) step count
        ours._learning_rate = theirs._learning_rate


def legacy_apply(optimizer, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable]) -> tf.Tensor:
    """A legacy optimizer's update of `variables` by the dense `grads`: the kernels, constraints and step
    count its `apply_gradients` runs, without the strategy's `update` (which refuses to run unaggregated
    under ParameterServerStrategy; the copies belong to no strategy). No clipping: `refusal` refuses it."""
    apply_state = optimizer._prepare(variables)
    kwargs = {"apply_state": apply_state} if "apply_state" in optimizer._dense_apply_args else {}
    updates = []
    for grad, variable in zip(grads, variables, strict=True):
        update = optimizer._resource_apply_dense(grad, variable, **kwargs)
        if variable.constraint is not None:
            with tf.control_dependencies([update]):
                update = variable.assign(variable.constraint(variable))
        updates.append(update)
    with tf.control_dependencies(updates):
        return optimizer.iterations.assign_add(1)


class DenseCopies:
    """The workers' copies of the dense variables and of their optimizer state (see the module)."""

    def __init__(self, strategy, job: Job, state, replica: Replica, worker0: str):
        """Copies of `replica`'s dense variables and a second optimizer from `job` over them; each is made
        on the workers from its counterpart on the ps (the coordinator's instance of each lives on
        `worker0`, not on the chief)."""
        trainable = trainable_of(replica.model)
        self.positions = [i for i, rows in enumerate(replica.sparse) if not rows]
        self.originals = [trainable[i] for i in self.positions]
        self.tables = [trainable[i] for i, rows in enumerate(replica.sparse) if rows]
        made: list[WorkerCopy] = []

        def creator(next_creator, **kwargs):
            made.append(WorkerCopy(strategy, next_creator, **kwargs))
            copy = made[-1]
            copy._unique_id = f"pstrain_worker_copy_{len(made)}"
            copy._constraint = None
            copy._distribute_strategy = None  # made outside any strategy scope (a legacy optimizer checks its slots are)
            return copy

        with tf.device(worker0), tf.variable_creator_scope(creator):
            self.copies = [tf.Variable(tf.zeros(v.shape, v.dtype), name=v.name.split(":")[0]) for v in self.originals]
            for copy, original in zip(self.copies, self.originals, strict=True):
                copy._constraint = original.constraint
            self.optimizer = job.optimizer_fn()
            share_hyperparameters(self.optimizer, state.optimizer)
            create_optimizer_slots(self.optimizer, self.copies)
            # The step the copies are at: a closure that ClusterCoordinator re-ran must not update them twice.
            self.step = tf.Variable(state.global_step.read_value, dtype=tf.int64, trainable=False, name="pstrain_copies_step")
        self.pairs = list(zip(self.copies, self.originals, strict=True))
        main = state.optimizer
        self.pairs.append((self.optimizer.iterations, main.iterations))
        self.pairs += slot_pairs(self.optimizer, main, self.copies, self.originals, self.positions)
        for copy, source in self.pairs:  # each worker's copy starts from the ps's value (made when first traced)
            made_by = copy._var_creator
            copy._var_creator = functools.partial(made_by.func, **{**made_by.keywords, "initial_value": source.read_value})
        self.held = places(replica.model, self.originals)
        # The workers' collective group, fresh for this chief: from the system's randomness, as the job's
        # seed fixes Python's `random` (tf_keras.utils.set_random_seed). Seeded, every engine of a process
        # drew the same key, and a second engine on the same servers met the first one's collectives.
        self.group_key = random.SystemRandom().randrange(1, 2**31)
        self.write_back = tf.function(self._write_back, autograph=False)

    def _write_back(self, step) -> tf.Tensor:
        """In a closure: this worker's copies written to the ps's variables, once they are found at `step`
        (the steps the ps counts as applied); fails (one line, the run restarts) otherwise, as for copies
        a worker restarted since the block made again from the ps's values of the block's start."""
        found = tf.debugging.assert_equal(
            self.step.read_value(), step, message=f"train.dense = allreduce: the write-back found its worker's {COPIES_ELSEWHERE}"
        )
        with tf.control_dependencies([found]):
            writes = [source.assign(copy.read_value()) for copy, source in self.pairs]
        with tf.control_dependencies(writes):
            return tf.constant(0)

    def apply(self, step, means) -> tf.Tensor:
        """In a replica context on a worker: `step`'s mean dense gradients applied to this worker's copies."""
        if isinstance(self.optimizer, tf_keras.optimizers.legacy.Optimizer):
            applied = legacy_apply(self.optimizer, means, self.copies)
        else:
            applied = self.optimizer.apply_gradients(zip(means, self.copies, strict=True), experimental_aggregate_gradients=False)
        with tf.control_dependencies([applied]):
            return self.step.assign(step + 1)

    @contextlib.contextmanager
    def hyperparameters_read_once(self) -> Iterator[None]:
        """Entered where a closure starts (outside its loop of steps), while it is traced: the copies'
        optimizer reads the hyperparameters it shares with the ps's (`share_hyperparameters`) once
        there, not once a step across the network. The same values: a callback sets them on the chief
        between blocks only, and a schedule of the step count is computed on the worker."""
        optimizer = self.optimizer
        legacy = isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer)
        saved = dict(optimizer._hyper) if legacy else optimizer._learning_rate
        try:
            if legacy:
                for name, value in saved.items():
                    if isinstance(value, tf.Variable):
                        optimizer._hyper[name] = value.read_value()
            elif isinstance(saved, tf.Variable):
                optimizer._learning_rate = saved.read_value()
            yield
        finally:
            if legacy:
                optimizer._hyper.clear()
                optimizer._hyper.update(saved)
            else:
                optimizer._learning_rate = saved

    def check_step(self, step) -> tf.Operation:
        """In a closure, before `step` reads the copies: fails (one line, the run stops) unless this worker's
        copies are at `step`, as after a closure re-run once its worker had updated them."""
        return tf.debugging.assert_equal(
            self.step.read_value(),
            step,
            message=f"train.dense = allreduce: a re-run closure found its worker's {COPIES_PAST}",
        )


def lean(dense: DenseCopies) -> bool:
    """Whether the hybrid step can leave the ps off a step's path (worker/replica/loop.py `lean_loop`):
    no row-sparse table to update there, and every dense variable float32, as the loss that is
    exchanged in one row with their gradients."""
    return not dense.tables and all(v.dtype == tf.float32 for v in dense.originals)


def collectives_lost(error: Exception) -> str | None:
    """Why `error` (from a block of the hybrid step) means the workers' collectives are lost, or None for
    another error: a closure re-run after a worker failed found its worker's copies updated
    (`DenseCopies.check_step`), or TF aborted the collectives. The chief exits 75; the launcher restarts
    every worker, then the chief (cluster/policy.py `collectives_decision`)."""
    text = str(error)
    if COPIES_PAST in text:
        return f"a closure re-run after a worker failed found its worker's {COPIES_PAST}"
    if COPIES_ELSEWHERE in text:
        return f"the write-back found its worker's {COPIES_ELSEWHERE} (a worker restarted)"
    if any(said in text for said in COLLECTIVES_LOST):
        return "a worker was lost and the workers' collectives were aborted"
    return None


class Watchdog:
    """Ends the process (one warning line on stderr, exit 75: the launcher restarts every worker, then the
    chief) when armed and not ticked for `limit_s` seconds."""

    def __init__(self, limit_s: float = WATCHDOG_S):
        self.limit_s, self.armed, self.last = limit_s, False, time.monotonic()
        threading.Thread(target=self._watch, name="pstrain-hybrid-watchdog", daemon=True).start()

    def tick(self) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            if self.armed and time.monotonic() - self.last > self.limit_s:
                sys.stderr.write(
                    f'pstrain: warning: train.dense = "allreduce": no progress for {self.limit_s:.0f}s (a worker failed '
                    "or hangs); the chief ends so that every worker restarts and it resumes from the last checkpoint\n"
                )
                sys.stderr.flush()
                os._exit(EXIT_RESTARTABLE)
