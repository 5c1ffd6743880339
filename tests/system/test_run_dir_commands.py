"""`pstrain status|stop|doctor --run-dir DIR` against a real local launch, as the README and the launch's
console line write them: no address, no token file; the step shown is current and says its age."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import PSTRAIN, ROOT, assert_no_orphans, metrics, run_pstrain, step_lines

pytestmark = pytest.mark.cluster


def pstrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(PSTRAIN + list(args), cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_status_doctor_and_stop_by_run_dir_on_a_local_launch(tmp_path):
    run_dir = tmp_path / "run"
    seen: dict = {}

    def drive() -> bool:
        if step_lines(run_dir) < 30 or not (run_dir / "control.json").exists():
            return False
        status = pstrain("status", "--run-dir", str(run_dir), "--json")
        seen["status"], seen["status_json"] = status, json.loads(status.stdout) if status.returncode == 0 else {}
        seen["steps_then"] = step_lines(run_dir)  # metrics.jsonl read after the status call
        seen["table"] = pstrain("status", "--run-dir", str(run_dir))
        seen["doctor"] = pstrain("doctor", "--run-dir", str(run_dir))
        seen["stop"] = pstrain("stop", "--run-dir", str(run_dir))
        return True

    result = run_pstrain(
        ["launch", "--run-dir", str(run_dir), "--steps", "30000", "--checkpoint-every", "50"],
        signal_when=drive,
        send=None,
        timeout=900,  # the stop ends it: the doctor's TensorFlow probe takes a minute on 2 busy cores
    )
    assert f"watch it with: pstrain status --run-dir {run_dir}" in result.output, result.output
    assert "pstrain: 4 local tasks (chief, 1 ps, 2 workers) starting" in result.output, result.output
    assert seen["status"].returncode == 0, seen["status"].stderr
    status = seen["status_json"]
    # The step shown is at least every step line written before the call (metrics.jsonl or the chief's
    # report, whichever is newer), and says how old it is.
    assert status["state"] == "training" and 30 <= status["step"] <= seen["steps_then"] + 64, status
    assert 0 <= status["step_age_s"] < 30, status
    assert {row["task"] for row in status["tasks"]} == {"chief:0", "ps:0", "worker:0", "worker:1"}
    assert seen["table"].returncode == 0 and "s old" in seen["table"].stdout.splitlines()[0], seen["table"].stdout
    doctor = seen["doctor"]
    assert doctor.returncode == 0 and "cluster.clock" in doctor.stdout, doctor.stdout + doctor.stderr
    assert not [line for line in doctor.stdout.splitlines() if line.startswith("FAIL")], doctor.stdout
    assert seen["stop"].returncode == 0 and seen["stop"].stdout.startswith("pstrain: stop requested"), seen["stop"].stderr
    assert result.returncode == 0, result.output
    stop_lines = [line for line in result.output.splitlines() if line.startswith("pstrain: stopped by pstrain stop from ")]
    assert len(stop_lines) == 1, result.output
    chief_log = (run_dir / "logs" / "chief-0.log").read_text()
    assert "stopped by pstrain stop from " in chief_log and "stopped by SIGTERM" not in chief_log, chief_log
    assert len(metrics(run_dir)[0]) < 30000
    assert_no_orphans(result)
    # The launch is over: its record is gone, and status says so in one line.
    assert not (run_dir / "control.json").exists()
    after = pstrain("status", "--run-dir", str(run_dir))
    assert after.returncode == 2 and after.stdout == "", after.stdout
    assert after.stderr.startswith(f"pstrain: error: --run-dir: {run_dir} has no control.json") and after.stderr.count("\n") == 1
