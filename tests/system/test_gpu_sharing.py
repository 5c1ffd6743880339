"""On a machine with GPUs: two workers train on them under worker_gpus = "auto", sharing a GPU where
there is one, each pinned where the plan says (its server's log) and none on the CPU."""

from __future__ import annotations

import re

import pytest

from cluster.launch.gpu_count import gpu_count
from tests.helpers import assert_no_orphans, run_pstrain

pytestmark = [pytest.mark.cluster, pytest.mark.gpu]


def test_two_workers_share_or_split_the_gpus_and_train(tmp_path):
    run_dir = tmp_path / "run"
    result = run_pstrain(["launch", "--workers", "2", "--steps", "20", "--checkpoint-every", "0", "--run-dir", str(run_dir)])
    assert result.returncode == 0, result.output[-3000:]
    assert_no_orphans(result)
    gpus = gpu_count()
    expected = ["0", "0"] if gpus == 1 else ["0", "1"]
    line = next(line for line in result.output.splitlines() if "GPUs: " in line)  # said at launch, in one line
    assert f"worker 0 GPU 0, worker 1 GPU {expected[1]}" in line
    assert ("memory growth on" in line) == (gpus == 1)
    for i, gpu in enumerate(expected):
        log = (run_dir / "logs" / f"worker-{i}.log").read_text()
        pinned = re.search(r"CUDA_VISIBLE_DEVICES='(\d*)' devices (\[.*\])", log)
        assert pinned and pinned.group(1) == gpu and "GPU" in pinned.group(2), log[:2000]
