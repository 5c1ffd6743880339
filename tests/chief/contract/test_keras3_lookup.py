"""A Keras 3 Embedding routed by pstrain (chief/contract/keras3_lookup.py) gathers on its table's
variables, never reading the whole table, and computes what Keras's own `call` computes: the same
output bits and the same row-sparse gradient, on a whole table and on one split into shards. In process."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute.sharded_variable import ShardedVariable

from chief.contract.keras3_lookup import div_split, route_lookups

pytestmark = pytest.mark.pure

ROWS, DIM = 1001, 8  # odd: the first of 2 shards has one row more
IDS = np.array([[3, -1, 3, 1000], [0, 501, 500, -1001]], np.int32)  # duplicates, both shards, negative ids


def sharded_creator(shards: int):
    """A variable creator splitting the table's rows over `shards` variables, as ParameterServerStrategy's
    partitioner does (rows in order, the first `ROWS % shards` one longer)."""

    def creator(next_creator, **kwargs):
        value = kwargs["initial_value"]
        value = value() if callable(value) else value
        if tuple(value.shape) != (ROWS, DIM):
            return next_creator(**kwargs)
        parts = tf.split(value, [ROWS // shards + (1 if i < ROWS % shards else 0) for i in range(shards)])
        return ShardedVariable([tf.Variable(p, name=f"part_{i}") for i, p in enumerate(parts)])

    return creator


def embedding(shards: int) -> keras.layers.Embedding:
    keras.utils.set_random_seed(3)
    layer = keras.layers.Embedding(ROWS, DIM)
    if shards == 1:
        layer.build()
    else:
        with tf.variable_creator_scope(sharded_creator(shards)):
            layer.build()
        assert isinstance(layer._embeddings.value, ShardedVariable)
    return layer


def run(layer: keras.layers.Embedding, call) -> tuple[np.ndarray, list]:
    """(output, [(indices, values) of the gradient of each table variable]) of `call(layer, ids)`,
    traced; and the graph's op types."""
    value = layer._embeddings.value
    variables = list(value.variables) if isinstance(value, ShardedVariable) else [value]
    weights = tf.reshape(tf.range(IDS.size * DIM, dtype=tf.float32), [*IDS.shape, DIM])

    @tf.function(autograph=False)
    def step(ids):
        with tf.GradientTape() as tape:
            out = call(layer, ids)
            loss = tf.reduce_sum(out * weights)
        return out, tape.gradient(loss, variables)

    out, grads = step(tf.constant(IDS))
    ops = {op.type for op in step.get_concrete_function(tf.TensorSpec(IDS.shape, tf.int32)).graph.get_operations()}
    assert all(isinstance(g, tf.IndexedSlices) for g in grads), "the gradient stays row-sparse"
    return out.numpy(), [(g.indices.numpy(), g.values.numpy()) for g in grads], ops


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_routed_lookup_gathers_on_the_table_and_equals_keras(shards):
    route_lookups()
    route_lookups()  # idempotent: one wrapper, Keras's own call beneath it
    routed = keras.layers.Embedding.call
    keras_call = routed.__wrapped__
    assert not hasattr(keras_call, "__wrapped__")
    layer = embedding(shards)
    ours, our_grads, our_ops = run(layer, lambda lay, ids: lay(ids))
    theirs, their_grads, their_ops = run(layer, keras_call)
    assert "ReadVariableOp" in their_ops, "Keras's own call reads the whole table"
    assert "ReadVariableOp" not in our_ops and "ResourceGather" in our_ops, our_ops
    assert ours.dtype == theirs.dtype and ours.shape == (*IDS.shape, DIM)
    np.testing.assert_array_equal(ours, theirs)
    assert len(our_grads) == len(their_grads) == shards
    for (i_ours, v_ours), (i_theirs, v_theirs) in zip(our_grads, their_grads, strict=True):
        np.testing.assert_array_equal(i_ours.astype(np.int64), i_theirs.astype(np.int64))
        np.testing.assert_array_equal(v_ours, v_theirs)


def test_keras_runs_where_the_table_is_not_one_plain_variable():
    """Float ids are cast as Keras casts them; a stateless call (its own values) goes through Keras."""
    route_lookups()
    layer = embedding(1)
    floats = tf.constant([[2.7, 0.0]])
    np.testing.assert_array_equal(layer(floats).numpy(), layer._embeddings.numpy()[[2, 0]][None])
    other = [np.zeros((ROWS, DIM), np.float32)]
    out, _ = layer.stateless_call(other, [], tf.constant([[5]]))
    assert not np.any(out.numpy())


def test_div_split_is_tfs_row_split():
    assert div_split([501, 500]) and div_split([334, 334, 333]) and div_split([7])
    assert not div_split([500, 501]) and not div_split([333, 334, 334])
