"""A Keras 3 `Embedding` looks its rows up where its table lives, as tf_keras's does.

Keras 3's `Embedding.call` is `ops.take(self.embeddings, ids, axis=0)`, and the TensorFlow backend's
`take` converts the variable to a tensor first: a `ReadVariableOp` of the whole table, then a
`GatherV2` wherever the step runs. On a cluster every worker pulls the whole table from its ps each
step (docs/embeddings.md has the measurement). tf_keras's lookup is `tf.nn.embedding_lookup` on the
variable: a `ResourceGather` colocated with it on its ps (one per shard of a `ShardedVariable`, ids
partitioned "div" as TF splits rows), and only the rows travel.

`route_lookups` makes every Keras 3 `Embedding` of the process do the latter. What the layer
computes is unchanged: a gather copies rows, so the output is the same bits; Keras's own steps
around the gather are kept (ids not int32/int64 cast to int32, negative ids wrapped as `take` wraps
them, the output cast to the compute dtype); the gradient is the same `IndexedSlices` (the touched
rows, per shard on a split table). Where the table is not one variable or a row-split set of them
(quantized, LoRA, sparse or ragged ids, a stateless call, a variable not created yet, shards not split
as TF's "div" lookup assumes) Keras's own `call` runs.
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

ROUTED = "_pstrain_routed"


def route_lookups() -> None:
    """Replace `keras.layers.Embedding.call` (the class's, so every instance and subclass calling
    `super().call`) by `routed_call`; Keras's own stays reachable as `__wrapped__`. Idempotent."""
    from keras.src.layers.core.embedding import Embedding

    if getattr(Embedding.call, ROUTED, False):
        return
    keras_call = Embedding.call

    @functools.wraps(keras_call)
    def call(self, inputs):
        tables = tables_of(self, inputs)
        return keras_call(self, inputs) if tables is None else lookup(self, tables, inputs)

    setattr(call, ROUTED, True)
    Embedding.call = call


def tables_of(layer: Any, inputs: Any) -> list | None:
    """The `tf.Variable`s holding `layer`'s table (one, or its shards in row order); None where
    Keras's own lookup must run."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    if layer.quantization_mode or layer.lora_enabled or in_stateless_scope():
        return None
    if isinstance(inputs, tf.SparseTensor | tf.RaggedTensor):
        return None
    value = getattr(getattr(layer, "_embeddings", None), "_value", None)  # what a Keras 3 variable wraps
    if isinstance(value, ShardedVariable):
        return list(value.variables) if div_split([int(v.shape[0]) for v in value.variables]) else None
    return [value] if isinstance(value, tf.Variable) else None


def div_split(rows: list[int]) -> bool:
    """Are shards of these row counts split as `tf.nn.embedding_lookup`'s "div" strategy assumes
    (the first `total % n` shards one row longer than the rest)?"""
    whole, extra = divmod(sum(rows), len(rows))
    return rows == [whole + (1 if i < extra else 0) for i in range(len(rows))]


def lookup(layer: Any, tables: list, inputs: Any) -> tf.Tensor:
    """Keras 3's `Embedding.call` with the gather run on the table's variables."""
    from keras import ops

    if inputs.dtype != "int32" and inputs.dtype != "int64":
        inputs = ops.cast(inputs, "int32")
    ids = tf.convert_to_tensor(inputs)
    total = sum(int(t.shape[0]) for t in tables)
    ids = tf.where(ids < 0, ids + tf.constant(total, ids.dtype), ids)  # take's wrap-around of negative ids
    return ops.cast(tf.nn.embedding_lookup(tables, ids), dtype=layer.compute_dtype)
