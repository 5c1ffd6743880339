"""A stop in the phases wall-clock timing rarely hits: during a checkpoint write, and during the run's
first (one-step) block. Each stop is sent on an event the test watches for (the write's `ckpt-N_temp`,
the chief's log line that the first block starts), and each run must end within one step of the stop,
resume to the uninterrupted model and leave nothing running. The other phases: tests/system/test_local_cluster.py.
The checkpoint write is made long enough to be seen: a 488 MiB table, which its ps writes in over a
second here (a 49 MiB one was written between two polls once in five runs)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from chief.jobs import digits
from tests import helpers
from tests.helpers import assert_no_orphans, metrics, predictions, run_pstrain, task_pid
from tests.jobs import tables
from tests.soak import compare_checkpoints
from tests.system.test_local_cluster import pstrain_stop

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
    assert_no_orphans(first)
    features, _ = digits.eval_data()
    resumes_to_the_uninterrupted_model(args, run_dir, tmp_path / "reference", steps, [], features)


def writing_checkpoints(checkpoints: Path) -> list[int]:
    """The steps of the checkpoints being written now (their `ckpt-N_temp` exists)."""
    temp = checkpoints.glob("ckpt-*_temp") if checkpoints.is_dir() else []
    return [int(m.group(1)) for p in temp if (m := re.match(r"ckpt-(\d+)_temp$", p.name))]


@contextlib.contextmanager
def ps_paused():
    """The run's ps task (this test's own, found by its TF_CONFIG under the launcher run_pstrain runs),
    suspended by pid (SIGSTOP) for the block and resumed after it: a write in progress stays in progress."""
    pid = task_pid(helpers.current_launcher, "ps", 0)
    assert pid is not None, "no ps task of this test's run was found to pause"
    tasks = [psutil.Process(pid)]
    try:
        for task in tasks:
            task.suspend()
        yield
    finally:
        for task in tasks:
            with contextlib.suppress(psutil.NoSuchProcess):  # killed meanwhile: the run's own failure says why
                task.resume()


def chief_heard(log: Path, line: str, within_s: float = 5.0) -> None:
    """Wait until the chief's log has `line` (its agent hears a stop at its next heartbeat, every 2 s);
    well inside the 10 s after which a paused task counts as lost."""
    deadline = time.monotonic() + within_s
    while line not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line in log.read_text(), f"the chief did not log {line!r} within {within_s} s"


def stop_during_a_write(args: list[str], run_dir: Path, stop) -> tuple:
    """Run `args`, sending `stop` (a signal, or `pstrain stop`) as soon as a checkpoint write is seen in
    progress; returns (the run, the step being written, whether it still was once the stop was sent,
    `pstrain stop`'s own result or None)."""
    checkpoints, seen, asked = run_dir / "checkpoints", [], []

    def a_write_in_progress() -> bool:
        if not seen and (steps := writing_checkpoints(checkpoints)):
            if stop == "pstrain stop":
                with ps_paused():  # the write waits for the chief to hear the stop: a process's start may outlast it
                    asked.append(pstrain_stop(run_dir))
                    chief_heard(run_dir / "logs" / "chief-0.log", "stopping: pstrain stop")
            seen.extend([steps[0], steps[0] in writing_checkpoints(checkpoints)])
        return bool(seen)

    result = run_pstrain(args, signal_when=a_write_in_progress, send=None if stop == "pstrain stop" else stop, poll_s=0.005)
    assert seen, f"no checkpoint write was seen in progress:\n{result.output}"
    return result, seen[0], seen[1], asked[0] if asked else None


def test_stops_during_checkpoint_writes_end_the_run_at_that_checkpoint(tmp_path):
    """SIGTERM while checkpoint 10 is written, then `pstrain stop` while the resumed run writes checkpoint 20
    (each sent when `ckpt-N_temp` appears; a 488 MiB table; the ps paused until the chief heard the
    `pstrain stop`, a process whose start may outlast the write): each write completes and the run stops at
    its step, noticed between blocks (no block runs after the stop) and not written twice, with one
    line naming the stop without `error`, exit 143 and 0, no half-written checkpoint and nothing left
    running. The third run ends with the uninterrupted run's checkpoint and predictions, bit for bit (a
    cluster run of this job differs from the standalone one by float rounding, 7e-9)."""
    steps, run_dir = 30, tmp_path / "run"
    job = ["--job", "tests.jobs.tables:big", "--global-batch-size", "32"]
    common = ["launch", *job, "--workers", "1", "--steps", str(steps), "--checkpoint-every", "10"]
    args = [*common, "--run-dir", str(run_dir)]
    log = run_dir / "logs" / "chief-0.log"
    for stop, expected in ((signal.SIGTERM, 10), ("pstrain stop", 20)):
        run, saving, still_writing, asked = stop_during_a_write(args, run_dir, stop)
        assert saving == expected, f"the first write seen was checkpoint {saving}"
        stopped_at = len(metrics(run_dir)[0])
        text = log.read_text()
        assert stopped_at == saving, f"a stop during checkpoint {saving}'s write stopped after step {stopped_at}:\n{text}"
        assert f"stop noticed at step {saving}, between blocks" in text, f"(still writing when sent: {still_writing})\n{text}"
        assert f"checkpoint {saving} is already written: the stop does not write it again" in text, text
        cause = "SIGTERM" if stop == signal.SIGTERM else "pstrain stop from "
        said = [line for line in run.output.splitlines() if line.startswith("pstrain:")]  # not TF's own start-up noise
        assert run.output.count("pstrain: stopped by") == 1 and not any("error" in line for line in said), run.output
        assert f"pstrain: stopped by {cause}" in run.output and f"after step {saving}; checkpoint saved" in run.output, run.output
        if asked:
            assert asked.returncode == 0 and run.returncode == 0, (asked.stderr, run.output)
        else:
            assert run.returncode == 128 + signal.SIGTERM, run.output
        assert not list((run_dir / "checkpoints").glob("*_temp*")), "no half-written checkpoint is left"
        assert f'model_checkpoint_path: "ckpt-{saving}"' in (run_dir / "checkpoints" / "checkpoint").read_text()
        assert_no_orphans(run)
        name = getattr(stop, "name", stop)
        print(f"{name}: sent while checkpoint {saving} was written (its temp still there after the send: {still_writing})")
    resumed = run_pstrain(args)
    assert resumed.returncode == 0, resumed.output
    assert [r["step"] for r in metrics(run_dir)[0]] == list(range(steps))
    assert_no_orphans(resumed)
    reference = tmp_path / "reference"
    uninterrupted = run_pstrain([*common, "--run-dir", str(reference)])
    assert uninterrupted.returncode == 0, uninterrupted.output
    largest, different = compare_checkpoints(run_dir, reference)
    assert different == [], f"the checkpoint differs from the uninterrupted run's in {different} (largest {largest})"
    features = tables.big.train_data()[0][:64]
    np.testing.assert_array_equal(predictions(run_dir, features), predictions(reference, features))
