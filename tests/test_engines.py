"""The two engines against each other in one process: ClusterEngine runs its closures on real TF
servers started in the test process (2 workers, 2 ps, see conftest.py), LocalEngine is the
standalone reference. Fast enough to cover a matrix (optimizers) that whole launches could not."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tf_keras

from chief.engines import ClusterEngine, LocalEngine
from chief.jobs import first_rows, load_job, recommender
from chief.optimizers import LazyAdam
from chief.sharding import read_full, shard_groups
from chief.sources import train_source
from cluster.config import TrainConfig

TABLES = recommender.small  # its user table is sharded over both ps (chief/sharding.py)

OPTIMIZERS = {
    "legacy SGD momentum": lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9),
    "legacy Adagrad": lambda: tf_keras.optimizers.legacy.Adagrad(0.1),
    "legacy Adam": lambda: tf_keras.optimizers.legacy.Adam(0.01),
    "legacy Ftrl": lambda: tf_keras.optimizers.legacy.Ftrl(0.1),
    "SGD momentum": lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9),
    "Adagrad": lambda: tf_keras.optimizers.Adagrad(0.1),
    "Adam": lambda: tf_keras.optimizers.Adam(0.01),
    "Ftrl": lambda: tf_keras.optimizers.Ftrl(0.1),
    "LazyAdam": lambda: LazyAdam(0.01),
}


def engine_inputs(job, train: TrainConfig, run_dir):
    """What the trainer hands an engine: the job's source (arrays written under `run_dir`) and one
    example's features."""
    return train_source(job, run_dir), first_rows(job.train_data()[0])


def run_both(resolver, job, steps: int, train: TrainConfig, run_dir):
    source, sample = engine_inputs(job, train, run_dir)
    cluster = ClusterEngine(job, train, source, sample, resolver=resolver)
    cluster.prepare(0)
    local = LocalEngine(job, train, source, sample)
    local.prepare(0)
    results = [(cluster.step(k), local.step(k)) for k in range(steps)]
    cluster.close()
    return cluster, local, results


def full_weights(engine, like: list[np.ndarray]) -> list[np.ndarray]:
    """The cluster model's weights read from the ps, shards joined to the shapes of `like`."""
    live = engine.state.model.weights
    groups = shard_groups([v.shape for v in live], [w.shape for w in like])
    return [read_full([live[i] for i in group]).numpy() for group in groups]


@pytest.mark.cluster  # a real TF cluster (in-process); about 5 s per case
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sparse_tables_train_as_standalone_with_every_optimizer(in_process_cluster, name, tmp_path):
    job = dataclasses.replace(load_job("chief.jobs.recommender"), optimizer_fn=OPTIMIZERS[name])
    job = dataclasses.replace(job, model_fn=TABLES.model_fn, train_data=TABLES.train_data)
    train = TrainConfig(job="recommender", steps=4, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    cluster, local, results = run_both(in_process_cluster, job, 4, train, tmp_path)
    assert any("/part_1" in v.name for v in cluster.state.model.weights), "the user table is sharded over both ps"
    assert (sum(local.sparse), sum(cluster.sparse)) == (5, 6), "every table (each shard of one) is row-sparse, the MLP dense"
    np.testing.assert_allclose([c.loss for c, _ in results], [s.loss for _, s in results], atol=1e-6)
    reference = local.state.model.get_weights()
    for got, want in zip(full_weights(cluster, reference), reference, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.cluster
def test_backup_slots_with_sparse_tables_apply_exactly_n(in_process_cluster, tmp_path):
    job = dataclasses.replace(load_job("chief.jobs.recommender"), model_fn=TABLES.model_fn, train_data=TABLES.train_data)
    train = TrainConfig(job="recommender", steps=6, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=3)
    cluster = ClusterEngine(job, train, *engine_inputs(job, train, tmp_path), resolver=in_process_cluster)
    cluster.prepare(0)
    results = [cluster.step(k) for k in range(6)]
    dropped = sum(r.stale_dropped for r in results) + cluster.close()
    assert all(r.aggregated == 2 and r.applied for r in results)
    assert dropped == 6, "one surplus gradient per step, dropped"
    assert int(cluster.state.global_step.numpy()) == 6


def test_lazy_adam_moves_only_touched_rows():
    """Stock Adam keeps moving a row its momentum remembers; LazyAdam moves only the rows in the gradient."""
    import tensorflow as tf

    for optimizer, moved_in_second_step in ((tf_keras.optimizers.legacy.Adam(0.1), [1, 2]), (LazyAdam(0.1), [1])):
        table = tf.Variable(tf.ones([4, 2]))
        optimizer.apply_gradients([(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2]), tf.constant([4, 2])), table)])
        before = table.numpy()
        optimizer.apply_gradients([(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([1]), tf.constant([4, 2])), table)])
        moved = np.flatnonzero(np.any(table.numpy() != before, axis=1)).tolist()
        assert moved == moved_in_second_step, (type(optimizer).__name__, moved)
