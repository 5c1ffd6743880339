"""A user's bug is theirs: `user_error` names the exception, the job's own file:line, and the step and
worker of a run-time error, without TensorFlow's and gRPC's wrapping (pure, on real exceptions)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from cluster.errors import EXIT_USAGE, error_text, failed_worker, user_error

pytestmark = pytest.mark.pure

JOB = """
import tensorflow as tf


def model_fn():
    raise RuntimeError("boom")


@tf.function
def checked(x):
    tf.debugging.assert_equal(x, 0.0, message="x moved")
    return x
"""


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "myjob.py"
    path.write_text(JOB)
    spec = importlib.util.spec_from_file_location("myjob", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("myjob", None)


def test_an_exception_raised_in_the_job_names_its_file_and_line(job):
    with pytest.raises(RuntimeError) as raised:
        job.model_fn()
    found = user_error(raised.value, job.__file__)
    assert found is not None and found.exit_code == EXIT_USAGE
    assert str(found) == f"RuntimeError: boom ({job.__file__}:6 in model_fn)"


def test_the_job_frame_is_found_through_a_wrapping_error(job):
    try:
        try:
            job.model_fn()
        except RuntimeError as e:
            raise ValueError("building the model failed") from e
    except ValueError as wrapped:
        assert str(user_error(wrapped, job.__file__)).endswith(f"({job.__file__}:6 in model_fn)")


def test_a_failing_assertion_at_run_time_names_the_line_that_defined_it_and_the_step(job):
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        job.checked(tf.constant(1.0))
    found = str(user_error(raised.value, job.__file__, step=2))
    assert found.startswith("InvalidArgumentError: assertion failed: [x moved] [Condition x == y did not hold")
    assert found.endswith(f"({job.__file__}:11 in checked) at step 2")
    assert "{{node" not in found and "Graph execution error" not in found


def test_a_workers_error_loses_the_grpc_wrapping_and_names_the_worker():
    """The message a chief got when an assertion failed on both workers (tests/data/README.md)."""
    job_file = str(Path(__file__).parents[1] / "jobs" / "broken.py")
    text = (Path(__file__).parents[1] / "data" / "worker_assert_error.txt").read_text().replace("{JOB_FILE}", job_file)
    error = tf.errors.InvalidArgumentError(None, None, text)
    assert failed_worker(error) == 0
    assert error_text(error).startswith("assertion failed: [the bias moved] [Condition x == y did not hold element-wise:]")
    found = str(user_error(error, job_file, step=1))
    assert found.endswith("(tests/jobs/broken.py:142 in call) at step 1 on worker 0")
    for noise in ("UNKNOWN", "grpc", "root error", "INVALID_ARGUMENT", "{{node", "[Op:"):
        assert noise not in found, found


def test_an_error_outside_the_job_is_not_the_users(job):
    try:
        int("x")
    except ValueError as e:
        assert user_error(e, job.__file__) is None
    assert user_error(RuntimeError("boom"), "") is None


def test_loss_fn_shape_diagnosis_only_for_shape_problems():
    """slot_loss says "make the labels match" for labels that do not fit the outputs, and lets a loss_fn's
    own bug through (then reported by user_error with its file:line)."""
    from chief.contract.job import Job, JobError
    from worker.replica.losses import slot_loss

    def job(loss_fn) -> Job:
        return Job("a job", lambda: None, loss_fn, lambda: None, None, None)

    predictions = tf.zeros((4, 10))

    def mismatched(y_true, y_pred):
        return tf.keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)

    with pytest.raises(JobError, match=r"loss_fn failed on labels of shape \[4, 3\] .* make the labels match"):
        slot_loss(job(mismatched), None, np.zeros((4, 3), np.int64), predictions, None, num_slots=2)

    def buggy(y_true, y_pred):
        raise ValueError("boom: not written yet")

    with pytest.raises(ValueError, match="boom: not written yet") as raised:
        slot_loss(job(buggy), None, np.zeros(4, np.int64), predictions, None, num_slots=2)
    assert type(raised.value) is ValueError, "the job's own error, not a shape diagnosis"
