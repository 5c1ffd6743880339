"""Initial values computed where each variable lives, identical to the one-process build.

Every topology builds the job's model right after `tf_keras.utils.set_random_seed(seed)`. tf_keras's
random initializers are stateless: each draws its seed from Keras's seed generator the first time it
is called (at variable creation, so in the same order in every build), and its value then depends
only on (shape, dtype, seed). Computed on a ps, it is the value a local build gets.

Under ParameterServerStrategy with a partitioner TF asks an initializer for each shard's own value
(`partition_shape`, `partition_offset`): a Keras initializer then folds the offset into its seed
and computes fans from the shard's shape, so the shards would not be the rows of the whole table,
and the initial weights would depend on the number of ps. `full_rows_initializers` gives every
shard exactly its rows of the full value instead, computed

- on the shard's ps, for a variable of at least `min_bytes` whose initializer is one of tf_keras's
  own (stateless random ones, zeros, ones, a scalar constant): nothing of it passes through the
  chief. The variable is created unfilled (`tf.raw_ops.Empty`: its pages are never touched), then
  each shard is assigned its rows in a function on its ps, right after the creation (so the
  initializer draws its seed in creation order). In a function the initializer's temporaries share
  one buffer, which the assign copies into the variable: while a shard is filled its ps holds the
  full value once beside the shard, where eagerly the draw, its scaling and its shift would each
  take a full-size tensor;
- on the chief, sent to the ps, for every other variable: small ones, and one whose initializer
  pstrain cannot reproduce on another device (a plain function, TF's stateful random ops, NumPy,
  an array constant); a large one of those is logged, since the chief then holds its value at
  start-up.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Iterator

import numpy as np
import tensorflow as tf
import tf_keras
from tf_keras.src.initializers import initializers as keras_initializers

from chief.contract.arrays import batches_of
from chief.contract.framework import seed_keras3
from chief.contract.job import JobError
from chief.state.unfilled import unfilled, variable_bytes

log = logging.getLogger("pstrain.chief")

# Variables at least this large (with a tf_keras initializer) get their initial value on their ps.
PS_INIT_MIN_BYTES = 1 << 20

# tf_keras's own initializer classes (Zeros, Constant, RandomUniform, VarianceScaling and its
# Glorot/He/LeCun subclasses, Orthogonal, Identity, ...): deterministic given (shape, dtype, seed).
KERAS_INITIALIZERS = frozenset(
    cls
    for cls in vars(keras_initializers).values()
    if isinstance(cls, type) and issubclass(cls, keras_initializers.Initializer) and cls is not keras_initializers.Initializer
)


def keras_initializer(initial_value) -> object | None:
    """The tf_keras initializer behind a variable's `initial_value` (tf_keras passes
    `functools.partial(initializer, shape, dtype=...)`), or None for anything else."""
    if isinstance(initial_value, functools.partial) and isinstance(initial_value.func, keras_initializers.Initializer):
        return initial_value.func
    return None


def reproducible_on_ps(initial_value) -> bool:
    """Whether computing `initial_value()` on another device gives the value a local build gets: one of
    tf_keras's own initializers, with a stateless generator if it draws random numbers (the
    subclasses a job defines may override `__call__`, so only the exact classes count), a constant
    only if it is a scalar."""
    initializer = keras_initializer(initial_value)
    if initializer is None or type(initializer) not in KERAS_INITIALIZERS:
        return False
    if isinstance(initializer, keras_initializers.Constant) and np.size(initializer.value) != 1:
        return False  # an array: it is in this process already (and would not fit in a function's graph)
    generator = getattr(initializer, "_random_generator", None)
    return generator is None or getattr(generator, "_rng_type", None) == "stateless"


class RowsOnChief:
    """A variable's initial value for TF's partitioned creation, computed on the chief (once, kept
    until its last rows are taken): the whole value when called without partition arguments, else
    the rows [offset, offset + rows) of the whole value."""

    def __init__(self, compute):
        self.compute = compute
        self._full: tf.Tensor | None = None

    def __call__(self, partition_shape=None, partition_offset=None) -> tf.Tensor:
        with tf.device(None):  # this process's CPU, whatever ps the variable is being created on
            full = self._full if self._full is not None else self.compute()
            if partition_offset is None:
                return full
            start, stop = partition_offset[0], partition_offset[0] + partition_shape[0]
            self._full = None if stop >= full.shape[0] else full
            return full[start:stop]


def fill_on_ps(variable, compute) -> None:
    """Assign every shard of `variable` (one, or a ShardedVariable's) its rows of `compute()`, each in a
    function on the shard's own device."""
    shards = list(getattr(variable, "variables", [variable]))
    start = 0
    for shard in shards:
        stop = start + (shard.shape[0] if shard.shape.rank else 0)

        def fill(shard=shard, start=start, stop=stop):
            full = compute()
            shard.assign(full if len(shards) == 1 else full[start:stop])

        with tf.device(shard.device), warnings.catch_warnings(), no_constant_folding():
            warnings.filterwarnings("ignore", message="The initializer .* is unseeded")  # called once per shard
            tf.function(fill, autograph=False)()
        start = stop


@contextlib.contextmanager
def no_constant_folding() -> Iterator[None]:
    """Functions instantiated in the block are not constant-folded; after it, the setting is as it was
    (unset, on or off). A stateless draw with a constant seed is foldable, so grappler computed a whole
    table's initial value on one thread, only to drop it as too large to keep: 9 s of a 10 M-row table's
    start-up. The values are the same either way. TF refreshes only the calling thread's cached call
    options: use it before other threads run functions (the model is built first)."""
    from tensorflow.python.eager import context

    ctx = context.context()
    options = ctx._optimizer_experimental_options  # tf.config.optimizer's setter only adds keys: restore by hand
    unset = "constant_folding" not in options
    before = options.get("constant_folding")
    ctx.set_optimizer_experimental_options({"constant_folding": False})
    try:
        yield
    finally:
        if unset:
            options.pop("constant_folding", None)
            ctx.set_optimizer_experimental_options({})  # drops this thread's cached call options
        else:
            ctx.set_optimizer_experimental_options({"constant_folding": before})


@contextlib.contextmanager
def full_rows_initializers(min_bytes: int = PS_INIT_MIN_BYTES) -> Iterator[dict[str, str]]:
    """Within the block (entered inside a ParameterServerStrategy scope), variables created with a
    callable initial value of known shape take the rows of the full value (see the module
    docstring). Yields {variable name: "ps" or "chief"}: where each value was computed."""
    where: dict[str, str] = {}

    def creator(next_creator, **kwargs):
        value = kwargs.get("initial_value")
        size = variable_bytes(kwargs.get("shape"), kwargs.get("dtype"))
        if not callable(value) or size is None:
            return next_creator(**kwargs)
        large = size >= min_bytes
        on_ps = large and reproducible_on_ps(value)
        name = kwargs.get("name") or "variable"
        if large and not on_ps:
            what = type(keras_initializer(value) or getattr(value, "func", value)).__name__
            log.info(
                "initial value of %s (%.1f MiB) computed on the chief: its initializer (%s) is not one that pstrain "
                "computes on the ps (tf_keras's own stateless ones)",
                name,
                size / 2**20,
                what,
            )
        kwargs["initial_value"] = unfilled(kwargs["shape"], kwargs["dtype"]) if on_ps else RowsOnChief(value)
        variable = next_creator(**kwargs)
        if on_ps:
            fill_on_ps(variable, value)
        first = getattr(variable, "variables", [variable])[0]  # a ShardedVariable's first shard
        where[first.name.split("/part_")[0].split(":")[0]] = "ps" if on_ps else "chief"
        return variable

    with tf.variable_creator_scope(creator):
        yield where


def build_layers(model: tf_keras.Model, sample) -> None:
    """Create every variable of `model` (its layers build at their first call) by tracing a call on
    `sample`, not running it: eagerly, an embedding lookup of a table sharded over ps tasks reads the
    whole table to this process (TF dispatches it to the shards only in graphs)."""
    refuse_batched_examples(model, sample)
    tf.function(lambda features: model(features, training=False)).get_concrete_function(sample)


def refuse_batched_examples(model: tf_keras.Model, sample) -> None:
    """Raise JobError when each feature of `sample` (a batch of examples) is itself a batch of what the
    model's input it feeds takes: the job's data yields batches, where pstrain batches single examples."""
    inputs, features = getattr(model, "inputs", None) or [], tf.nest.flatten(sample)
    if not batches_of([list(f.shape[1:]) for f in features], [i.shape[1:] for i in inputs]):
        return
    found, takes = list(features[0].shape[1:]), ["None", *inputs[0].shape[1:]]
    raise JobError(
        f"model_fn: the model takes inputs of shape [{', '.join(map(str, takes))}], but the training examples have "
        f"shape {found}: the data yields batches; give single examples, which pstrain batches to "
        "--global-batch-size (remove the .batch() from the job's data)"
    )


def seeded_build(job_model_fn, seed: int, sample) -> tf_keras.Model:
    """The job's model with all its variables, built right after seeding: the draws of its
    initializers are the same in every topology."""
    tf_keras.utils.set_random_seed(seed)
    seed_keras3(seed)  # a Keras 3 job's global SeedGenerator too
    model = job_model_fn()
    build_layers(model, sample)
    return model
