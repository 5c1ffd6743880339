"""A standalone run's console carries pstrain's lines only: TensorFlow's C++ start-up lines (written by
native code to descriptor 2, at import and at the first ops) go to RUN_DIR/logs/standalone.log."""

from __future__ import annotations

import re

import pytest

from tests.helpers import assert_no_orphans, run_pstrain

pytestmark = pytest.mark.cluster
PSTRAINS = re.compile(r"^(pstrain: |step \d+/\d+ |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} pstrain\.)")
NATIVE = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d|WARNING: All log messages before absl::InitializeLog)")


def test_every_console_line_of_a_standalone_run_is_pstrains(tmp_path):
    run_dir = tmp_path / "run"
    result = run_pstrain(["train", "--standalone", "--steps", "20", "--run-dir", str(run_dir)], timeout=300)
    assert result.returncode == 0, result.output
    lines = result.output.splitlines()
    assert lines and lines[-1].startswith("pstrain: done in "), result.output
    assert [line for line in lines if not PSTRAINS.match(line)] == [], result.output
    log = (run_dir / "logs" / "standalone.log").read_text()
    assert any(NATIVE.match(line) for line in log.splitlines()), f"TensorFlow's start-up lines are in the log:\n{log}"
    assert_no_orphans(result)


def test_a_standalone_mistake_still_reaches_the_console(tmp_path):
    """Python's stderr stays on the console: a job that fails says so there, in one line."""
    job = tmp_path / "broken_job.py"
    job.write_text("raise RuntimeError('the job module itself fails')\n")
    result = run_pstrain(
        ["train", "--standalone", "--steps", "2", "--job", "broken_job", "--run-dir", str(tmp_path / "run")],
        timeout=300,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode != 0 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("pstrain: error:")]
    assert len(errors) == 1 and "the job module itself fails" in errors[0], result.output
