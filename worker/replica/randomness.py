"""Random layers (Dropout, GaussianNoise, random augmentation) drawing per-(seed, step, slot) numbers.

While a replica's step is traced, every tf_keras `RandomGenerator` of the model is switched to
stateless Philox ops whose seed is folded from (seed, step, slot, layer position, call count): the
same (step, slot) draws the same numbers on any worker, however often its closure runs, and the
standalone engine draws the same. `rng_alg="philox"` pins the algorithm (`auto_select` may differ
by device). A Keras 3 layer draws through its `keras.random.SeedGenerator`s, whose `next()` (a seed
read from, and a write to, the generator's state variable) is replaced by the same folded seed: its
stateless ops then draw per (seed, step, slot), and the state is never written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import tensorflow as tf
import tf_keras
from tf_keras.src.backend import RandomGenerator

from chief.contract.framework import keras3_seed_generators

ALG = "philox"
OVERRIDDEN = ("dropout", "random_uniform", "random_normal", "truncated_normal", "make_seed_for_stateless_op")


def _generators(model: tf_keras.Model) -> list[tuple[int, object]]:
    """(layer position, generator) for every layer of `model` that owns a RandomGenerator."""
    out = []
    for position, layer in enumerate(model._flatten_layers(include_self=False)):
        generator = getattr(layer, "_random_generator", None)
        if isinstance(generator, RandomGenerator):
            out.append((position, generator))
    return out


def step_seed(seed: int, step, slot) -> tf.Tensor:
    """The [2] int64 seed of one (seed, step, slot)."""
    base = tf.constant([seed, 0x5EED], tf.int64)
    base = tf.random.experimental.stateless_fold_in(base, tf.cast(step, tf.int64), alg=ALG)
    return tf.random.experimental.stateless_fold_in(base, tf.cast(slot, tf.int64), alg=ALG)


@contextlib.contextmanager
def stateless_random(model: tf_keras.Model, seed: int, step, slot) -> Iterator[None]:
    """Within the block, the model's random layers draw from per-(seed, step, slot) stateless streams."""
    generators = _generators(model)
    base = step_seed(seed, step, slot) if generators else None  # no random layers: no ops at all
    for position, generator in generators:
        layer_seed = tf.random.experimental.stateless_fold_in(base, position, alg=ALG)
        calls = [0]

        def next_seed(_layer_seed=layer_seed, _calls=calls) -> tf.Tensor:
            _calls[0] += 1
            return tf.random.experimental.stateless_fold_in(_layer_seed, _calls[0], alg=ALG)

        def dropout(inputs, rate, noise_shape=None, _next=next_seed):
            return tf.nn.experimental.stateless_dropout(inputs, rate=rate, seed=_next(), rng_alg=ALG, noise_shape=noise_shape)

        def random_uniform(shape, minval=0.0, maxval=None, dtype=None, nonce=None, _next=next_seed):
            dtype = dtype or tf_keras.backend.floatx()
            return tf.random.stateless_uniform(shape, seed=_next(), minval=minval, maxval=maxval, dtype=dtype, alg=ALG)

        def random_normal(shape, mean=0.0, stddev=1.0, dtype=None, nonce=None, _next=next_seed):
            dtype = dtype or tf_keras.backend.floatx()
            return tf.random.stateless_normal(shape, seed=_next(), mean=mean, stddev=stddev, dtype=dtype, alg=ALG)

        def truncated_normal(shape, mean=0.0, stddev=1.0, dtype=None, nonce=None, _next=next_seed):
            dtype = dtype or tf_keras.backend.floatx()
            return tf.random.stateless_truncated_normal(shape, seed=_next(), mean=mean, stddev=stddev, dtype=dtype, alg=ALG)

        overrides = {
            "dropout": dropout,
            "random_uniform": random_uniform,
            "random_normal": random_normal,
            "truncated_normal": truncated_normal,
            "make_seed_for_stateless_op": next_seed,
        }
        for name, fn in overrides.items():
            object.__setattr__(generator, name, fn)
    seed_generators = keras3_seed_generators(model)
    base = base if base is not None or not seed_generators else step_seed(seed, step, slot)
    for position, index, generator in seed_generators:
        generator_seed = tf.random.experimental.stateless_fold_in(
            tf.random.experimental.stateless_fold_in(base, position, alg=ALG), index, alg=ALG
        )
        calls = [0]

        def next_seed(ordered=True, _seed=generator_seed, _calls=calls) -> tf.Tensor:
            _calls[0] += 1
            return tf.random.experimental.stateless_fold_in(_seed, _calls[0], alg=ALG)

        generator.next = next_seed
    try:
        yield
    finally:
        for _, generator in generators:
            for name in OVERRIDDEN:
                generator.__dict__.pop(name, None)
        for _, _, generator in seed_generators:
            generator.__dict__.pop("next", None)
