"""The checks and helpers on a job's arrays: `checked_arrays` (what a data function returns),
`batches_of` (data that yields batches where pstrain wants single examples), text as fixed-width
arrays and its tf.DType, and rows of every array of a nest. Errors are one-line JobErrors."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from chief.contract.job import JobError


def checked_arrays(spec: str, what: str, data: Any) -> tuple:
    """Validate a data function's result: (features, labels) or (features, labels, sample_weights),
    each a NumPy array or a nest (dict, tuple, list) of arrays, all with the same number of rows."""
    if not (isinstance(data, tuple) and len(data) in (2, 3)):
        raise JobError(
            f"--job {spec}: {what}() must return (features, labels) or (features, labels, sample_weights); "
            "each an array or a dict/tuple of arrays"
        )
    data = tuple(tf.nest.map_structure(lambda a: fixed_width(np.asarray(a), f"--job {spec}: {what}()"), part) for part in data)
    parts = ("features", "labels", "sample_weights")
    lengths = {
        f"{parts[i]}{'' if len(tf.nest.flatten(part)) == 1 else f'[{j}]'}": (len(a) if a.ndim else 0)
        for i, part in enumerate(data)
        for j, a in enumerate(tf.nest.flatten(part))
    }
    if len(set(lengths.values())) != 1 or 0 in lengths.values():
        shown = ", ".join(f"{name} {n}" for name, n in lengths.items())
        raise JobError(f"--job {spec}: {what}() returned {shown} rows; they must match and be non-empty")
    return data


def batches_of(example_shapes: list, example_of: list) -> bool:
    """Whether each of `example_shapes` (an example's feature shapes) is a batch of examples of the
    matching `example_of` shape: one leading dimension more, not of size 1 (Keras squeezes a trailing
    1 away: a column of shape [1] feeds an input of shape [])."""
    return len(example_shapes) == len(example_of) > 0 and all(
        len(found) == len(of) + 1 and found[0] != 1 and tf.TensorShape(found[1:]).is_compatible_with(of)
        for found, of in zip(example_shapes, example_of, strict=True)
    )


def fixed_width(array: np.ndarray, what: str) -> np.ndarray:
    """`array` with text as fixed-width NumPy strings: an object array of `str` becomes `U`, of `bytes`
    `S` (what `.npy` files hold and the workers decode in-graph); other arrays are returned as they are."""
    if array.dtype != object:
        return array
    kinds = {type(x) for x in array.flat}
    if kinds <= {str} or kinds <= {bytes}:
        return array.astype(str if kinds <= {str} else bytes)
    found = ", ".join(sorted(k.__name__ for k in kinds))
    raise JobError(f"{what}: an object array holds {found}; give text as str (or bytes) and numbers as a numeric array")


def tensor_dtype(array: Any) -> Any:
    """The tf.DType of a NumPy array or tensor: tf.string for text (`U`, `S` or object arrays)."""
    if isinstance(array, np.ndarray) and array.dtype.kind in "USO":
        return tf.string
    return tf.as_dtype(array.dtype)


def rows(nest: Any, index: Any) -> Any:
    """`array[index]` for every array of a nest (a slice, or an array of positions)."""
    return tf.nest.map_structure(lambda a: a[index], nest)


def first_rows(features: Any, n: int = 1) -> Any:
    """The first `n` rows of every array of a features nest (a sample for building a model)."""
    return rows(features, slice(0, n))
