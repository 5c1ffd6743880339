"""A job module that fixes TensorFlow's threads and visible devices at import (tests/jobs/tf_settings.py):
the cluster chief imports it after joining the cluster, when TF refuses those calls; they are skipped
with a note in the chief's log (chief/contract/tf_settings.py), and the run equals standalone bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import assert_no_orphans, run_pstrain

pytestmark = pytest.mark.cluster

JOB = ["--job", "tests.jobs.tf_settings", "--steps", "4", "--global-batch-size", "16"]


def values(run_dir) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(run_dir / "checkpoints")))
    return {
        k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if "VARIABLE_VALUE" in k and "save_counter" not in k
    }


def test_settings_at_import_are_skipped_on_the_chief_and_the_run_equals_standalone(tmp_path):
    cluster = run_pstrain(["launch", *JOB, "--run-dir", str(tmp_path / "cluster")], timeout=300)
    assert cluster.returncode == 0, cluster.output
    assert_no_orphans(cluster)
    log = (tmp_path / "cluster" / "logs" / "chief-0.log").read_text()
    threading = "tf.config.threading.set_{}_op_parallelism_threads"
    for skipped in (threading.format("inter"), threading.format("intra"), "tf.config.set_logical_device_configuration"):
        assert f"--job tests.jobs.tf_settings: {skipped} at import skipped" in log, log
    local = run_pstrain(["train", "--standalone", *JOB, "--run-dir", str(tmp_path / "standalone")], timeout=300)
    assert local.returncode == 0, local.output
    a, b = values(tmp_path / "standalone"), values(tmp_path / "cluster")
    assert sorted(a) == sorted(b) and len(a) > 4
    assert all(np.array_equal(a[k], b[k]) for k in a), [k for k in a if not np.array_equal(a[k], b[k])]
