"""A TensorFlow error raised while pstrain builds a step from a job's examples, as one line.

The job's own code (its file) reports its errors itself (cluster/errors.py `user_error`); an error
raised in pstrain's or TensorFlow's code while a slot's step is traced on the job's data (sample
weights that cannot be laid over the loss, a dtype TensorFlow cannot convert) becomes a
`UserCodeError` naming the job's data function and the shapes of the slot's features, labels and
weights. The trainer prints its line and puts the original traceback in the log.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import tensorflow as tf

from chief.contract.job import Job, JobError, job_file
from cluster.errors import UserCodeError, error_text, job_frame

_NODE = re.compile(r" for '\{\{node .*")  # a traced op's definition and input shapes, after the message


def data_function(job: Job) -> str:
    """The job's function that gives its training examples, as the user wrote it."""
    for name in ("train_dataset", "train_arrays", "train_data"):
        if getattr(job, name, None) is not None:
            return f"{name}()"
    return "the training data"


def shapes(nest: Any) -> str:
    """The static shapes of a nest of tensors, `?` for an unknown dimension."""

    def shape(t: Any) -> str:
        dims = getattr(t, "shape", None)
        if dims is None or dims.rank is None:
            return "?"
        return "[" + ", ".join("?" if d is None else str(d) for d in dims.as_list()) + "]"

    return str(tf.nest.map_structure(shape, nest)).replace("'[", "[").replace("]'", "]").replace("'?'", "?")


def build_error(error: Exception, job: Job, data: tuple) -> UserCodeError:
    """The one line for `error`, raised while a step was built from the slot's `data`."""
    parts = ("features", "labels", "sample weights")
    given = ", ".join(f"{parts[i]} {shapes(part)}" for i, part in enumerate(data[:3]))
    sentences = _NODE.sub("", error_text(error)).split(". ")
    text = ". ".join(s for s in sentences if "://" not in s).strip().rstrip(".")  # no "See https://... for ..."
    found = UserCodeError(
        f"{data_function(job)}: pstrain could not build a training step from its examples ({given}): "
        f"{type(error).__name__}: {text}; check that the examples' shapes and dtypes fit the model and its loss"
    )
    found.__cause__ = error
    return found


@contextmanager
def building_from(job: Job, data: tuple) -> Iterator[None]:
    """Within the block (a slot's step being traced on `data`), a TypeError or ValueError that did not
    come through the job's own file is raised as `build_error`'s one line; JobErrors pass as they are."""
    try:
        yield
    except JobError:
        raise
    except (TypeError, ValueError) as e:
        if job_frame(e, job_file(job.spec)) is not None:
            raise  # the job's own code: reported with its file and line
        raise build_error(e, job, data) from e
