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


def test_the_chief_holds_no_copy_of_a_large_table(tmp_path):
    """The chief's peak resident memory (the done line's `peak_rss_mib`, the kernel's high-water mark)
    with a 488 MiB table minus that with a 250 KiB one, same data and steps. On 1 ps, through the
    final checkpoint (the ps writes the table), evaluation and export (the ps writes it too): less than
    a quarter of the table (before: one full copy, the checkpoint mirror). Resumed on 2 ps from that
    checkpoint (restored into two shards): the export alone copies the table to the chief (TF cannot
    export a table split over ps, chief/state/route.py), so one copy at most."""
    from tests.jobs.tables import big

    def peak(job: str, run_dir, ps: int, steps: int) -> int:
        common = ["--steps", str(steps), "--checkpoint-every", "0", "--global-batch-size", "32", "--workers", "1"]
        result = run_pstrain(["launch", "--job", f"tests.jobs.tables:{job}", *common, "--ps", str(ps), "--run-dir", str(run_dir)])
        assert result.returncode == 0, result.output
        return metrics(run_dir)[1]["peak_rss_mib"]

    table_mib = big.table_bytes / 2**20
    baseline = peak("tiny", tmp_path / "tiny", ps=1, steps=3)
    fresh = peak("big", tmp_path / "big", ps=1, steps=3)
    assert fresh - baseline < 0.25 * table_mib, (fresh, baseline, table_mib)
    resumed = peak("big", tmp_path / "big", ps=2, steps=6)
    assert resumed - baseline < 2.0 * table_mib, (resumed, baseline, table_mib)
