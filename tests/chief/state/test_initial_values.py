"""Initial values made where the variables live (chief/state/initial_values.py), equal to the one-process build.

The unit tests run locally; the cluster tests use the in-process cluster (2 workers, 2 ps) of
conftest.py, where the recommender's user table is sharded over both ps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from chief.contract.job import JobError, load_job
from chief.jobs import recommender
from chief.state.initial_values import (
    RowsOnChief,
    build_layers,
    fill_on_ps,
    full_rows_initializers,
    no_constant_folding,
    reproducible_on_ps,
    seeded_build,
)
from chief.state.model_state import initial_weights
from chief.state.sharding import partitioner
from chief.state.unfilled import unfilled, unfilled_initializers
from chief.step.dispatch import ClusterEngine
from chief.step.local import LocalEngine
from chief.step.strategy import PeeredPSStrategy
from cluster.config import TrainConfig
from tests.chief.step.test_dispatch import engine_inputs, full_weights

TABLES = recommender.small  # user table 20,000 x 8 (625 KiB): sharded over 2 ps; item table 62.5 KiB
LOW = 64 << 10  # forces the user table (not the item table) onto the ps path


def recommender_job(**changes):
    job = dataclasses.replace(load_job("chief.jobs.recommender"), model_fn=TABLES.model_fn, train_data=TABLES.train_data)
    return dataclasses.replace(job, **changes)


@pytest.mark.pure
def test_only_tf_keras_stateless_initializers_are_reproduced_on_the_ps():
    class Scaled(tf_keras.initializers.RandomUniform):  # a job's subclass may compute anything
        pass

    def of(initializer):
        return functools.partial(initializer, (4, 2), dtype=tf.float32)  # how tf_keras passes it

    assert all(map(reproducible_on_ps, [of(tf_keras.initializers.RandomUniform()), of(tf_keras.initializers.GlorotNormal())]))
    assert reproducible_on_ps(of(tf_keras.initializers.Zeros())) and reproducible_on_ps(of(tf_keras.initializers.Orthogonal()))
    assert reproducible_on_ps(of(tf_keras.initializers.Constant(0.1)))
    assert not reproducible_on_ps(of(tf_keras.initializers.Constant(np.ones((4, 2)))))  # an array: already on the chief
    assert not reproducible_on_ps(of(Scaled()))
    assert not reproducible_on_ps(of(lambda shape, dtype=None: tf.random.uniform(shape, dtype=dtype)))
    assert not reproducible_on_ps(of(tf.compat.v1.keras.initializers.RandomUniform()))  # stateful TF1 ops
    assert not reproducible_on_ps(lambda: tf.zeros((4, 2)))


@pytest.mark.pure
def test_each_shard_gets_its_rows_of_the_full_value():
    initializer = tf_keras.initializers.GlorotUniform(seed=3)  # fans from the full shape, not the shard's
    full = initializer((10, 4), dtype=tf.float32).numpy()
    compute = functools.partial(initializer, (10, 4), dtype=tf.float32)
    on_chief = RowsOnChief(compute)  # as TF's partitioned creation calls it
    parts = [on_chief(partition_shape=(n, 4), partition_offset=(start, 0)).numpy() for start, n in ((0, 4), (4, 3), (7, 3))]
    np.testing.assert_array_equal(np.concatenate(parts), full)
    np.testing.assert_array_equal(RowsOnChief(compute)().numpy(), full)

    class Sharded:  # a ShardedVariable's shards (local here)
        variables = [tf.Variable(unfilled((n, 4), tf.float32)(partition_shape=(n, 4))) for n in (4, 3, 3)]

    fill_on_ps(Sharded, compute)
    np.testing.assert_array_equal(np.concatenate([v.numpy() for v in Sharded.variables]), full)
    whole = tf.Variable(unfilled((10, 4), tf.float32)())
    fill_on_ps(whole, compute)
    np.testing.assert_array_equal(whole.numpy(), full)


@pytest.mark.pure
def test_constant_folding_is_off_only_inside_the_fill(monkeypatch):
    """The fill turns grappler's constant folding off (it computed whole tables to throw them away) and
    leaves the setting as it found it: unset, or set either way."""
    import chief.state.initial_values as initial_values

    options = tf.config.optimizer.get_experimental_options
    assert "constant_folding" not in options()
    with no_constant_folding():
        assert options()["constant_folding"] is False
    assert "constant_folding" not in options()
    for setting in (True, False):
        tf.config.optimizer.set_experimental_options({"constant_folding": setting})
        with no_constant_folding():
            assert options()["constant_folding"] is False
        assert options()["constant_folding"] is setting
    from tensorflow.python.eager import context

    context.context()._optimizer_experimental_options.pop("constant_folding")  # unset again, for the next tests
    tf.config.optimizer.set_experimental_options({})  # and this thread's cached call options with it
    entered = []

    @contextlib.contextmanager
    def spy():
        entered.append(True)
        with no_constant_folding():
            yield

    monkeypatch.setattr(initial_values, "no_constant_folding", spy)
    whole = tf.Variable(unfilled((6, 4), tf.float32)())
    fill_on_ps(whole, functools.partial(tf_keras.initializers.RandomUniform(seed=1), (6, 4), dtype=tf.float32))
    assert entered == [True], "the fill runs without constant folding"


@pytest.mark.pure
def test_unfilled_build_calls_no_initializer():
    calls = []

    def counted(shape, dtype=None):
        calls.append(shape)
        return tf.ones(shape, dtype)

    with unfilled_initializers():
        model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(4, kernel_initializer=counted)])
    assert calls == [] and [w.shape for w in model.weights] == [(3, 4), (4,)]
    model.weights[0].assign(tf.ones((3, 4)))  # a normal variable once written
    assert model.weights[0].numpy().sum() == 12


@pytest.mark.inprocess
def test_sharded_table_made_on_the_ps_starts_and_trains_as_standalone(in_process_cluster, tmp_path, caplog):
    job = recommender_job()
    train = TrainConfig(job="recommender", steps=4, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    source, sample = engine_inputs(job, train, tmp_path)
    with caplog.at_level(logging.INFO, logger="pstrain.chief"):
        cluster = ClusterEngine(job, train, source, sample, resolver=in_process_cluster, ps_init_min_bytes=LOW)
    assert "initial values computed on the ps: user_embedding/embeddings" in caplog.text
    assert "item_embedding" not in caplog.text.split("computed on the ps:")[1].splitlines()[0], "below the threshold: chief"
    assert any("user_embedding/embeddings/part_1" in v.name for v in cluster.state.model.weights)
    reference = initial_weights(job, train.seed, sample)  # the standalone's initial weights
    for got, want in zip(full_weights(cluster, reference), reference, strict=True):
        np.testing.assert_array_equal(got, want)
    local = LocalEngine(job, train, source, sample)
    cluster.prepare(0)
    local.prepare(0)
    results = list(zip(cluster.run(0, 2) + cluster.run(2, 2), local.run(0, 4), strict=True))
    cluster.close()
    np.testing.assert_allclose([c.loss for c, _ in results], [s.loss for _, s in results], atol=1e-6)
    trained = local.state.model.get_weights()
    assert not np.array_equal(trained[0], reference[0]), "the user table trained"
    for got, want in zip(full_weights(cluster, trained), trained, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.inprocess
def test_tf_own_sharded_initialization_would_not_be_the_full_table(in_process_cluster):
    """Why full_rows_initializers exists: left to TF, a Keras initializer gives each shard values of
    its own (seed folded with the offset), not the full table's rows."""
    strategy = PeeredPSStrategy(in_process_cluster, variable_partitioner=partitioner(2))
    job = recommender_job()
    sample = {k: v[:1] for k, v in TABLES.train_data()[0].items()}
    reference = seeded_build(job.model_fn, 0, sample).get_weights()
    with strategy.scope():
        plain = seeded_build(job.model_fn, 0, sample)
        with full_rows_initializers(0):
            ours = seeded_build(job.model_fn, 0, sample)
    user = [i for i, w in enumerate(reference) if w.shape == (TABLES.users, TABLES.dim)][0]
    assert not np.array_equal(full_weights_of(plain, reference)[user], reference[user])
    for got, want in zip(full_weights_of(ours, reference), reference, strict=True):
        np.testing.assert_array_equal(got, want)


def full_weights_of(model, like):
    class Engine:
        state = type("State", (), {"model": model})

    return full_weights(Engine, like)


@pytest.mark.inprocess
def test_an_initializer_pstrain_cannot_reproduce_is_computed_on_the_chief(in_process_cluster, tmp_path, caplog):
    """A plain function (here TF's stateful random op) for the large table: made on the chief, logged, still equal."""

    def model_fn():
        table = tf_keras.layers.Embedding(
            TABLES.users, TABLES.dim, embeddings_initializer=lambda shape, dtype=None: tf.random.uniform(shape, dtype=dtype)
        )
        inputs = tf_keras.Input(shape=(), dtype="int32", name="user")
        return tf_keras.Model({"user": inputs}, tf_keras.layers.Dense(2)(table(inputs)))

    def train_data():
        features, labels = TABLES.train_data()
        return {"user": features["user"]}, labels

    job = recommender_job(model_fn=model_fn, train_data=train_data)
    train = TrainConfig(job="custom", steps=2, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    source, sample = engine_inputs(job, train, tmp_path)
    with caplog.at_level(logging.INFO, logger="pstrain.chief"):
        cluster = ClusterEngine(job, train, source, sample, resolver=in_process_cluster, ps_init_min_bytes=LOW)
    assert "computed on the chief: its initializer (function)" in caplog.text
    reference = initial_weights(job, train.seed, sample)
    for got, want in zip(full_weights(cluster, reference), reference, strict=True):
        np.testing.assert_array_equal(got, want)
    cluster.close()


@pytest.mark.pure
def test_examples_that_are_batches_are_refused_naming_both_shapes():
    """A pipeline that batches with drop_remainder=True gives examples of one shape, each a batch."""
    model = tf_keras.Sequential([tf_keras.Input((8, 8, 1)), tf_keras.layers.Flatten(), tf_keras.layers.Dense(2)])
    with pytest.raises(JobError) as raised:
        build_layers(model, np.zeros((1, 32, 8, 8, 1), np.float32))
    assert str(raised.value).startswith(
        "model_fn: the model takes inputs of shape [None, 8, 8, 1], but the training examples have shape [32, 8, 8, 1]"
    )
    build_layers(model, np.zeros((1, 8, 8, 1), np.float32))  # single examples build it
    # A column of shape [1] feeding an input of shape [] is one example: Keras squeezes the trailing 1.
    column = tf_keras.Input((), dtype="string")
    text = tf_keras.Model(column, tf_keras.layers.StringLookup(vocabulary=["a", "b"], output_mode="one_hot")(column))
    build_layers(text, np.array([["a"]]))
