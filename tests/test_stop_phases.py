"""A stop in the phases wall-clock timing rarely hits: during a checkpoint write, and during the run's
first (one-step) block. Each stop is sent on an event the test watches for (the write's `ckpt-N_temp`,
the chief's log line that the first block starts), and each run must end within one step of the stop,
resume to the uninterrupted model and leave nothing running. The other phases: tests/test_local_cluster.py."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from chief.jobs import digits
from tests.helpers import assert_no_orphans, metrics, predictions, run_pstrain
from tests.jobs import tables
from tests.test_local_cluster import pstrain_stop

pytestmark = pytest.mark.cluster


def noticed_steps(run_dir: Path) -> list[int]:
    """The steps at which the chief noticed a stop (in a block, or between blocks), from its log."""
    return [int(n) for n in re.findall(r"stop noticed at step (\d+)", (run_dir / "logs" / "chief-0.log").read_text())]


def resumes_to_the_uninterrupted_model(args: list[str], run_dir: Path, reference: Path, steps: int, job, features) -> None:
    """The same command resumes and ends with the model of an uninterrupted standalone run."""
    second = run_pstrain(args)
    assert second.returncode == 0, second.output
    assert [r["step"] for r in metrics(run_dir)[0]] == list(range(steps))
    uninterrupted = run_pstrain(["train", "--standalone", *job, "--run-dir", str(reference), "--steps", str(steps)])
    assert uninterrupted.returncode == 0, uninterrupted.output
    np.testing.assert_allclose(predictions(run_dir, features), predictions(reference, features), atol=1e-4, rtol=0)
    assert_no_orphans(second)


def test_a_sigterm_during_a_checkpoint_write_stops_after_it(tmp_path):
    """SIGTERM while the ps write checkpoint N (a 49 MiB table; sent when `ckpt-N_temp` appears): the
    write completes, the run stops within one step of N with a complete checkpoint, exits 143, and
    resumes exactly."""
    steps, run_dir = 30, tmp_path / "run"
    job = ["--job", "tests.jobs.tables:mid"]
    args = ["launch", *job, "--run-dir", str(run_dir), "--steps", str(steps), "--checkpoint-every", "10"]
    checkpoints = run_dir / "checkpoints"
    writing: list[int] = []

    def checkpoint_being_written() -> bool:
        temp = [p.name for p in checkpoints.glob("ckpt-*_temp")] if checkpoints.is_dir() else []
        writing.extend(int(re.match(r"ckpt-(\d+)_temp", name).group(1)) for name in temp[:1])
        return bool(temp)

    first = run_pstrain(args, signal_when=checkpoint_being_written, send=signal.SIGTERM, poll_s=0.005)
    assert writing, "a checkpoint write was seen in progress"
    saving = writing[0]
    assert first.returncode == 128 + signal.SIGTERM, first.output
    stopped_at = len(metrics(run_dir)[0])
    assert saving <= stopped_at <= saving + 1, f"SIGTERM during checkpoint {saving}'s write, stopped after step {stopped_at}"
    assert noticed_steps(run_dir) and noticed_steps(run_dir)[0] <= saving + 1, (run_dir / "logs" / "chief-0.log").read_text()
    line = f"pstrain: stopped by SIGTERM after step {stopped_at}; checkpoint saved"
    said = [line for line in first.output.splitlines() if line.startswith("pstrain:")]
    assert line in first.output and not any("error" in line for line in said), first.output
    assert not list(checkpoints.glob("*_temp*")), "no half-written checkpoint is left"
    assert f'model_checkpoint_path: "ckpt-{stopped_at}"' in (checkpoints / "checkpoint").read_text()
    assert_no_orphans(first, within_s=10)
    features, _ = tables.mid.train_data()
    resumes_to_the_uninterrupted_model(args, run_dir, tmp_path / "reference", steps, job, features[:64])


@pytest.mark.parametrize("stop", [signal.SIGTERM, "pstrain stop"], ids=["sigterm", "pstrain-stop"])
def test_a_stop_during_the_first_block_ends_the_run_after_step_one(tmp_path, stop):
    """A stop sent when the chief logs that its first (one-step, tracing) block starts: noticed at step 0
    or 1, the run stops after at most step 1 (not at the end of the next block), exits 0 for `pstrain
    stop` and 143 for SIGTERM, says what stopped it without `error`, and resumes exactly."""
    steps, run_dir = 40, tmp_path / "run"
    args = ["launch", "--run-dir", str(run_dir), "--steps", str(steps), "--checkpoint-every", "20"]
    log = run_dir / "logs" / "chief-0.log"
    asked: list[subprocess.CompletedProcess] = []

    def first_block_started() -> bool:
        started = log.exists() and "first block starting at step 0" in log.read_text()
        if started and stop == "pstrain stop" and not asked:
            asked.append(pstrain_stop(run_dir))
        return started

    first = run_pstrain(args, signal_when=first_block_started, send=None if stop == "pstrain stop" else stop, poll_s=0.005)
    text = log.read_text()
    noticed = noticed_steps(run_dir)
    assert noticed and noticed[0] <= 1, f"the stop arrived during the first block:\n{text}"
    stopped_at = len(metrics(run_dir)[0])
    assert stopped_at <= noticed[0] + 1, f"noticed at step {noticed[0]}, stopped after step {stopped_at}"
    cause = "SIGTERM" if stop == signal.SIGTERM else "pstrain stop from "
    assert f"pstrain: stopped by {cause}" in first.output, first.output
    said = [line for line in first.output.splitlines() if line.startswith("pstrain:")]  # not TF's own start-up noise
    assert first.output.count("pstrain: stopped by") == 1 and not any("error" in line for line in said), first.output
    if stopped_at:
        assert f" after step {stopped_at}; checkpoint saved" in first.output, first.output
    if stop == "pstrain stop":
        assert asked[0].returncode == 0, asked[0].stderr
        assert first.returncode == 0, first.output
    else:
        assert first.returncode == 128 + signal.SIGTERM, first.output
    assert not list((run_dir / "checkpoints").glob("*_temp*")), "no half-written checkpoint is left"
    assert_no_orphans(first, within_s=10)
    features, _ = digits.eval_data()
    resumes_to_the_uninterrupted_model(args, run_dir, tmp_path / "reference", steps, [], features)
