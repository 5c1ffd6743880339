"""Embedding tables on a real local cluster (processes): sparse gradients, a table sharded over two
ps, and the result equal to the standalone run. The optimizer matrix runs in tests/test_engines.py."""

from __future__ import annotations

import numpy as np
import pytest

from chief.jobs import recommender
from tests.helpers import assert_no_orphans, metrics, predictions, run_pstrain

pytestmark = pytest.mark.cluster

JOB = "chief.jobs.recommender:small"


def test_sharded_embedding_tables_train_as_the_standalone_run(tmp_path):
    common = ["--job", JOB, "--steps", "30", "--global-batch-size", "128"]
    cluster = run_pstrain(["launch", *common, "--ps", "2", "--run-dir", str(tmp_path / "cluster")])
    assert cluster.returncode == 0, cluster.output
    standalone = run_pstrain(["train", "--standalone", *common, "--run-dir", str(tmp_path / "standalone")])
    assert standalone.returncode == 0, standalone.output
    log = (tmp_path / "cluster" / "logs" / "chief-0.log").read_text()
    assert "row-sparse gradients (only touched rows move): " in log and "user_embedding/embeddings" in log
    placement = [line for line in log.splitlines() if "placement:" in line][-1]
    assert "user_embedding/embeddings (2 shards)" in placement, placement
    steps, done = metrics(tmp_path / "cluster")
    assert all(s["aggregated"] == 2 for s in steps) and done["steps"] == 30
    features = recommender.small.eval_data()[0]
    np.testing.assert_allclose(
        predictions(tmp_path / "cluster", features), predictions(tmp_path / "standalone", features), atol=1e-4
    )
    assert_no_orphans(cluster)
