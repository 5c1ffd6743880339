"""Bytes per variable from the user's job (chief/variable_bytes.py): tables move the rows a
batch touches, every other variable moves whole."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from chief.jobs.recommender import small  # imports TensorFlow at collection, before the tier guard
from chief.variable_bytes import job_variables

pytestmark = pytest.mark.pure


def test_tables_move_touched_rows_and_dense_variables_move_whole():
    per_worker = 32
    variables = {v["name"].split("/")[0]: SimpleNamespace(**v) for v in job_variables("chief.jobs.recommender:small", per_worker)}
    user = variables["user_embedding"]
    assert user.bytes == small.users * small.dim * 4 and user.rows == small.users
    features = small.train_data()[0]
    # the probe samples per_worker examples: at most that many distinct users, at least one
    row_bytes = small.dim * 4 + 8
    assert row_bytes <= user.push_bytes <= per_worker * row_bytes and user.pull_bytes == user.push_bytes
    assert user.push_bytes % row_bytes == 0
    assert len(np.unique(features["user"])) > per_worker  # so a table's whole would be far more than what moved
    dense = [v for name, v in variables.items() if "embedding" not in name]
    assert dense and all(v.push_bytes == v.pull_bytes == v.bytes for v in dense)
