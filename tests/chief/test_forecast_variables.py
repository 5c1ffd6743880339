"""Bytes per variable from the user's job (chief/variable_bytes.py): tables move the rows a
batch touches, every other variable moves whole."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from chief.jobs.recommender import small  # imports TensorFlow at collection, before the tier guard
from chief.variable_bytes import job_summary, job_variables

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
    assert dense and all(v.push_bytes == v.pull_bytes == v.bytes and not v.row_sparse for v in dense)
    assert all(v.row_sparse for name, v in variables.items() if "embedding" in name)


def test_a_keras3_table_is_split_as_the_launch_splits_it_and_moves_its_rows():
    """tests/jobs/keras3.py's Sharded table (3000 x 48 float32): the launch on 2 ps splits it in 2 shards
    (tests/system/test_keras3.py), and so does the forecast; its lookup gathers on the ps
    (chief/contract/keras3_lookup.py) and its gradient is row slices, so only the touched rows move."""
    from cluster.forecast.model import Variable, shards

    found = {v["name"]: v for v in job_variables("tests.jobs.keras3:Sharded", 16)}
    table = Variable(**found["big_table/embeddings:0"])
    assert table.bytes == 3000 * 48 * 4 and table.rows == 3000
    assert shards(table, 2) == 2 and shards(table, 1) == 1
    import keras

    from chief.contract.keras3_lookup import ROUTED

    assert getattr(keras.layers.Embedding.call, ROUTED, False), "loading the job routed the lookup to the ps"
    assert table.pull_bytes == table.push_bytes < table.bytes and table.push_bytes % (48 * 4 + 8) == 0


def test_a_keras3_table_the_launch_refuses_split_says_why():
    """ShardedLamb (Lamb's update of the table is not elementwise) is refused on 2 ps by the launch
    (tests/system/test_keras3.py); the forecast's variables carry the launch's reason, the plan finds it
    at 2 ps, and Sharded (Adam, a NonNeg kernel) carries none."""
    from cluster.forecast.model import Variable, refused_split

    lamb = [Variable(**v) for v in job_variables("tests.jobs.keras3:ShardedLamb", 16)]
    table = next(v for v in lamb if v.name == "big_table/embeddings:0")
    assert table.split_refused.startswith("optimizer_fn: a Keras 3 Lamb updates big_table/embeddings as a whole")
    assert refused_split(lamb, [1, 4, 2]) == (2, table.split_refused) and refused_split(lamb, [1]) is None
    adam = [Variable(**v) for v in job_variables("tests.jobs.keras3:Sharded", 16)]
    assert not any(v.split_refused for v in adam) and refused_split(adam, [1, 2, 4]) is None


@pytest.mark.parametrize(
    ("job", "refused", "slots"),
    [
        ("tests.jobs.hybrid:tower", "", 2),  # Adam: m and v written back with each dense copy
        ("tests.jobs.hybrid:momentum", "", 1),
        ("tests.jobs.wide_deep", "does not keep forward-pass state (BatchNormalization)", 0),
        ("tests.jobs.keras3:Sharded", "takes tf_keras models only (the job uses Keras 3)", 0),
        ("chief.jobs.recommender:small", "", 1),  # a legacy Adagrad: its accumulator
        ("chief.jobs.digits", "", 2),  # a legacy Adam
        ("tests.jobs.hybrid:clipped", "does not take clipping", 0),
    ],
)
def test_what_allreduce_makes_of_the_job_is_the_launchs_own_refusal(job, refused, slots):
    """The plan predicts train.dense = "allreduce" only where the launch's check (chief/step/hybrid.py
    `refusal`) takes the job, and says the launch's line where it does not."""
    found = job_summary(job, 16)
    if refused:
        assert found["allreduce_refused"].startswith('train.dense = "allreduce"') and refused in found["allreduce_refused"]
    else:
        assert found["allreduce_refused"] == ""
    assert found["slots"] == slots
