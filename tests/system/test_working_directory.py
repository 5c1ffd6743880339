"""A user's job in their own working directory, run as docs/jobs.md says (`pstrain launch --job my_job`
from the directory that holds it), with the run directory named `cluster` there, like one of pstrain's
packages: the tasks, started in that directory, still import pstrain's own `cluster` (the launcher puts
pstrain's root on their PYTHONPATH: cluster/launch/supervisor.py `packages_first`)."""

from __future__ import annotations

import pytest

from tests.helpers import assert_no_orphans, run_pstrain

pytestmark = pytest.mark.cluster

JOB = """
import numpy as np
import tensorflow as tf


def model_fn():
    return tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])


loss_fn = "mse"


def optimizer_fn():
    return tf.keras.optimizers.SGD(0.1)


def train_data():
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True)
"""


def test_a_run_dir_named_like_a_pstrain_package_in_the_working_directory(tmp_path):
    (tmp_path / "my_job.py").write_text(JOB)
    args = ["launch", "--job", "my_job", "--steps", "3", "--global-batch-size", "8", "--run-dir", "cluster"]
    result = run_pstrain(args, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert (tmp_path / "cluster" / "saved_model").is_dir()
    assert_no_orphans(result)
