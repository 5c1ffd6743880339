"""The embedding benchmark's Keras 3 twin (tests/benchmarks/embeddings.py --keras3): a Keras 3 job with
the tf_keras job's variables, shape for shape, its data and batch, so the two can be timed side by side."""

from __future__ import annotations

import keras  # noqa: F401 (imported at collection, before the tier guard: importing it runs `uname -p`)
import numpy as np
import pytest
import tensorflow as tf

from chief.contract.job import load_job
from tests.benchmarks.embeddings import JOBS, JOBS_KERAS3, KERAS3, ROWS

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("size", ["1k", "1m"])
def test_twin_is_keras3_with_the_same_variables_and_data(size):
    twin, job = load_job(JOBS_KERAS3[size]), load_job(JOBS[size])
    assert (twin.framework, job.framework) == ("keras3", "tf_keras")
    shapes = [[tuple(v.shape) for v in j.model_fn().weights] for j in (twin, job)]
    assert shapes[0] == shapes[1] and shapes[0][0] == (ROWS[size], 64)
    data = [j.train_dataset() for j in (twin, job)]  # the same drawn examples (tests/benchmarks/drawn.py)
    for i in (0, 12345):
        for a, b in zip(*(tf.nest.flatten(tf.data.experimental.at(d, i)) for d in data), strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert KERAS3.startswith("pstrain")  # run_peer launches it as pstrain (tests/benchmarks/bench.py peer_pstrain)
