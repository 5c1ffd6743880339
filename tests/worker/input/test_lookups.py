"""Lookup tables in the workers' pipeline (worker/input/lookups.py), on the in-process cluster: a table
that Keras makes while the per-worker pipeline is traced gets a copy on each worker, and every batch a
worker reads is the one the standalone stream reads."""

from __future__ import annotations

import threading

import pytest
import tensorflow as tf
import tf_keras
from tensorflow.python.distribute import ps_values

from chief.step.strategy import PeeredPSStrategy
from worker.input.lookups import local_lookups, lookups_on_workers
from worker.input.streams import StreamSource

pytestmark = pytest.mark.inprocess

VOCABULARY = ["red", "green", "blue"]
WORDS = ["red", "green", "blue", "grey", "blue", "red"] * 4  # "grey": the out-of-vocabulary id 0


def keras_lookup(made: list):
    """A train_dataset() with a StringLookup made inside it, as TF's ParameterServerStrategy tutorial makes one."""

    def train_dataset() -> tf.data.Dataset:
        lookup = tf_keras.layers.StringLookup(vocabulary=VOCABULARY)
        made.append(lookup.lookup_table)
        return tf.data.Dataset.from_tensor_slices(WORDS).map(lambda w: (lookup(w), tf.strings.length(w)))

    return train_dataset


def constants_lookup(made: list):
    """A hand-written StaticHashTable over tf.constants made inside train_dataset()."""

    def train_dataset() -> tf.data.Dataset:
        keys, values = tf.constant(VOCABULARY), tf.constant([1, 2, 3], tf.int64)
        table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(keys, values), default_value=0)
        made.append(table)
        return tf.data.Dataset.from_tensor_slices(WORDS).map(lambda w: (table.lookup(w), tf.strings.length(w)))

    return train_dataset


@pytest.mark.parametrize(
    ("pipeline", "per_worker"), [(keras_lookup, True), (constants_lookup, False)], ids=["keras", "constants"]
)
def test_a_lookup_in_the_pipeline_reads_on_each_worker_what_the_standalone_stream_reads(in_process_cluster, pipeline, per_worker):
    """Keras's table (made in tf.init_scope) is a DistributedTable while the workers' pipeline is traced,
    a plain table in the chief's own reads; a table over the traced function's constants stays one table
    (on the chief, as before). Either way every worker reads the standalone stream's ids."""
    made: list = []
    source = StreamSource(pipeline(made), "train_dataset()", None, slot_batch=4, slots=2)
    source.begin(0)
    expected = source.fingerprint()
    standalone = {}
    batches = source.local_batches()
    for _ in range(6):
        where, (ids, _) = next(batches)
        standalone[int(where[0])] = ids.numpy().tolist()
    assert standalone[0] == [1, 2, 3, 0], "red, green, blue, then grey: out of the vocabulary"
    built_here = len(made)
    assert not any(isinstance(t, ps_values.DistributedTable) for t in made), "the chief's own reads keep a local table"
    strategy = PeeredPSStrategy(in_process_cluster)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(local_lookups(strategy, source.dataset_fn)))
    traced = made[built_here:]
    assert traced and all(isinstance(t, ps_values.DistributedTable) == per_worker for t in traced), [type(t) for t in traced]

    @tf.function
    def closure(iterator, step, slot):
        (ids, _), where, _ = source.worker_batch(iterator, step, slot, expected)
        return ids, where

    where = [(tf.constant(j // 2, tf.int64), tf.constant(j % 2, tf.int64)) for j in range(6)]  # (step, slot)
    reads = [coordinator.schedule(closure, args=(iterator, *at)) for at in where]
    joined = threading.Thread(target=coordinator.join, daemon=True)  # join() itself has no time limit
    joined.start()
    joined.join(timeout=120)
    assert not joined.is_alive(), "the closures did not finish within 120 s"
    for j, remote in enumerate(reads):
        ids, where = remote.fetch()
        assert int(where[0]) == j and ids.tolist() == standalone[j], j


def test_a_table_the_chief_makes_while_it_imports_the_job_gets_a_copy_per_worker_unless_read_from_a_file(
    in_process_cluster, tmp_path
):
    """A lookup layer at the job module's top level (made eagerly, under `lookups_on_workers`) is a
    DistributedTable; one read from a vocabulary file stays one table (a worker would read its own
    disk's file), as does one made outside the scope."""
    strategy = PeeredPSStrategy(in_process_cluster)
    vocabulary = tmp_path / "vocabulary.txt"
    vocabulary.write_text("\n".join(VOCABULARY) + "\n")
    with lookups_on_workers(strategy):
        given = tf_keras.layers.StringLookup(vocabulary=VOCABULARY)
        from_file = tf_keras.layers.StringLookup(vocabulary=str(vocabulary))
    outside = tf_keras.layers.StringLookup(vocabulary=VOCABULARY)
    assert isinstance(given.lookup_table, ps_values.DistributedTable)
    assert not isinstance(from_file.lookup_table, ps_values.DistributedTable)
    assert not isinstance(outside.lookup_table, ps_values.DistributedTable)
    for layer in (given, from_file, outside):  # in the chief's own reads, each gives the vocabulary's ids
        assert layer(tf.constant(WORDS[:4])).numpy().tolist() == [1, 2, 3, 0]
