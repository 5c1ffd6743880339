"""Variables created unfilled: their initializers never run, their values unspecified until written.

`unfilled` is such an initial value (`tf.raw_ops.Empty`: a buffer's pages become resident only when
written); `unfilled_initializers` creates every variable of known shape that way within its block,
for a model whose every value is written before it is read (chief/contract/job_compiled.py builds the job's
model so; chief/state/initial_values.py fills large variables on their ps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import tensorflow as tf


def unfilled(shape, dtype):
    """An initial value of `shape` and `dtype` (or the partition's shape) with unspecified contents,
    made where the variable is created: memory a buffer's pages take only once they are written."""
    shape, dtype = tf.TensorShape(shape), tf.as_dtype(dtype).base_dtype

    def value(partition_shape=None, partition_offset=None) -> tf.Tensor:
        return tf.raw_ops.Empty(shape=list(partition_shape or shape.as_list()), dtype=dtype, init=False)

    return value


def variable_bytes(shape, dtype) -> int | None:
    """Bytes of a variable of `shape` and `dtype`; None when either is not fully known."""
    if shape is None or dtype is None:
        return None
    shape = tf.TensorShape(shape)
    if not shape.is_fully_defined():
        return None
    return shape.num_elements() * tf.as_dtype(dtype).size


@contextlib.contextmanager
def unfilled_initializers() -> Iterator[None]:
    """Within the block, variables created with a callable initial value of known shape start with
    unspecified values (`tf.raw_ops.Empty`), their initializers never called: for a copy whose every
    value is written before it is read. Pages of a new buffer become resident only when written, so
    such a variable costs no memory until then."""

    def creator(next_creator, **kwargs):
        shape, dtype = kwargs.get("shape"), kwargs.get("dtype")
        if callable(kwargs.get("initial_value")) and variable_bytes(shape, dtype) is not None:
            kwargs["initial_value"] = unfilled(shape, dtype)
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield
