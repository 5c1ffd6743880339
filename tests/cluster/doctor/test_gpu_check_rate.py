"""deploy/gpu_check.sh's throughput figure (cluster/doctor/gpu_check.py): eval lines are not steps."""

from __future__ import annotations

import json

import pytest

from cluster.doctor.gpu_check import examples_per_second
from cluster.rundir import RunDir

pytestmark = pytest.mark.pure


def test_eval_lines_between_steps_are_skipped(tmp_path):
    lines = [{"step": s, "seconds": 0.5 if s < 3 else 0.1 * (s - 2)} for s in range(6)]  # 0.1, 0.2, 0.3 after tracing
    lines.insert(4, {"event": "eval", "step": 3, "eval_loss": 0.2})  # --eval-every: a line with a step, no seconds
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "cluster.json").write_text(json.dumps({"train": {"global_batch_size": 64}}))
    assert abs(examples_per_second(RunDir(tmp_path)) - 64 / 0.2) < 1e-9
