"""Faults on a real local cluster: each run must end with the same model as a fault-free run.

The reference is the standalone run (tests/system/test_local_cluster.py proves a fault-free cluster run
equals it), with the same job, seed, steps and global batch.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from chief.jobs import digits
from chief.state.checkpoints import remove_partial_saves
from tests.helpers import assert_no_orphans, chief_restart_warning, kill_task_when, metrics, predictions, run_pstrain, step_lines
from tests.soak import Fault, report, run_soak

pytestmark = pytest.mark.cluster

STEPS = 150


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Fault-free predictions for a number of steps (standalone runs, cached)."""
    cache: dict[int, np.ndarray] = {}

    def get(steps: int) -> np.ndarray:
        if steps not in cache:
            run_dir = tmp_path_factory.mktemp("reference") / "run"
            result = run_pstrain(["train", "--standalone", "--run-dir", str(run_dir), "--steps", str(steps)])
            assert result.returncode == 0, result.output
            cache[steps] = predictions(run_dir, digits.eval_data()[0])
        return cache[steps]

    return get


@pytest.fixture(scope="module")
def reference(references) -> np.ndarray:
    return references(STEPS)


def assert_same_model(run_dir: Path, reference: np.ndarray, steps: int = STEPS) -> None:
    records, done = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(steps)), "every step exactly once"
    assert all(r["aggregated"] == 2 for r in records)
    assert done is not None and done["steps"] == steps
    np.testing.assert_allclose(predictions(run_dir, digits.eval_data()[0]), reference, atol=1e-4, rtol=0)


def launch_args(run_dir: Path, steps: int = STEPS) -> list[str]:
    return ["launch", "--run-dir", str(run_dir), "--steps", str(steps), "--checkpoint-every", "25"]


def test_soak_worker_killed_ps_killed_worker_hung_ends_with_the_fault_free_model(tmp_path):
    """tests/soak.py, short: the wide-and-deep job (a table sharded over 2 ps, BatchNorm, Dropout) on 2 ps
    and 2 workers. worker-1 is killed at step 30 (restarted, its closures re-run); ps-1, holding a shard
    of the table, at step 130 (restarted, and the chief with it, resuming from step 100); worker-0 hangs
    (SIGSTOP) at step 230: silent past the heartbeat timeout, pstrain kills and restarts it. The final
    checkpoint equals the fault-free run's bit for bit and nothing is left running."""
    steps = 300
    faults = [Fault(30, "worker", 1, "kill"), Fault(130, "ps", 1, "kill"), Fault(230, "worker", 0, "freeze")]
    outcome = run_soak(tmp_path, steps, faults)
    print(report(outcome))
    assert [i.fault for i in outcome.injected] == faults, "every fault was injected"
    assert outcome.returncode == 0, outcome.output
    output = outcome.output
    assert "pstrain: warning: worker-1 exited (137); restarting (1 of 4) in 1s" in output
    assert "pstrain: warning: ps-1 exited (137); restarting (1 of 4)" in output
    # the checkpoint before the kill at step 130: 100, or 125 when the step-125 checkpoint was written first
    resumed = re.search(r"pstrain: warning: lost ps-1; restarting the chief to resume from checkpoint step (\d+) ", output)
    assert resumed and int(resumed[1]) in (100, 125), output
    assert "pstrain: warning: worker-0 sent no heartbeat for 4s (hung?) and was killed; restarting (1 of 4) in 1s" in output
    assert "killed by pstrain" in outcome.injected[2].note
    assert "pstrain: error" not in output and "run the same command" not in output, "recoveries are warnings"
    assert outcome.every_step_once
    records, _ = metrics(tmp_path / "run")
    assert any(1 in r["workers"] for r in records[150:]), "the restarted worker-1 contributes again"
    assert outcome.different == [] and outcome.max_difference == 0.0, "the fault-free model, bit for bit"
    assert outcome.left_running == []


def test_ps_killed_cluster_restarts_it_and_recomputes_lost_steps(tmp_path, reference):
    """The one ps is killed (one of 2, holding a shard of a table: the soak test above)."""
    run_dir, killed, victim = tmp_path / "run", [], 0
    args = [*launch_args(run_dir), "--ps", "1"]
    result = run_pstrain(args, signal_when=kill_task_when(run_dir, "ps", victim, 40, killed), send=None)
    assert killed
    assert result.returncode == 0, result.output
    assert f"pstrain: warning: ps-{victim} exited (137); restarting (1 of 3)" in result.output
    assert chief_restart_warning(f"ps-{victim}") in result.output
    assert "pstrain: error" not in result.output and "run the same command" not in result.output, "pstrain recovers by itself"
    assert "resumed" in (run_dir / "logs" / "chief-0.log").read_text() or "steps 25.." in result.output
    assert_same_model(run_dir, reference)
    assert_no_orphans(result)


def test_chief_killed_same_command_resumes(tmp_path, reference):
    run_dir, killed = tmp_path / "run", []
    first = run_pstrain(launch_args(run_dir), signal_when=kill_task_when(run_dir, "chief", 0, 60, killed), send=None)
    assert killed
    assert first.returncode == 128 + signal.SIGKILL, first.output
    assert_no_orphans(first)
    second = run_pstrain(launch_args(run_dir))
    assert second.returncode == 0, second.output
    resumed_at = int(re.search(r"steps (\d+)\.\.150", second.output).group(1))
    assert resumed_at >= 50 and resumed_at % 25 == 0, "resumed from the last checkpoint before the kill"
    assert_same_model(run_dir, reference)
    assert_no_orphans(second)


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # garbled: 64 bytes flipped in the middle, the size unchanged
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :])


@pytest.mark.parametrize("how, resume", [("truncated", "standalone"), ("garbled", "cluster")])
def test_damaged_newest_checkpoint_resumes_from_the_one_before(tmp_path, how, resume):
    """The newest checkpoint's data file is damaged after a finished run: running again says which file
    is bad, resumes from the previous checkpoint (standalone, or on a cluster through the chief's mirror),
    and ends with the same model."""
    run_dir = tmp_path / "run"
    flags = ["--run-dir", str(run_dir), "--steps", str(STEPS), "--checkpoint-every", "25"]
    args = ["train", "--standalone", *flags]
    first = run_pstrain(args)
    assert first.returncode == 0, first.output
    reference = predictions(run_dir, digits.eval_data()[0])
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("*.index")) == ["ckpt-100.index", "ckpt-125.index", "ckpt-150.index"]
    files = sorted(checkpoints.glob("ckpt-150.data-*"), key=lambda p: p.stat().st_size)
    data = files[-1]  # the weights' file (the chief's save counter has one of its own)
    damage(data, how)
    (checkpoints / "ckpt-175_temp").mkdir()  # what a save cut short leaves
    (checkpoints / "ckpt-175_temp" / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"\0" * 1000)
    second = run_pstrain(args if resume == "standalone" else ["launch", *flags])
    assert second.returncode == 0, second.output
    named = data if len(files) == 1 else checkpoints / "ckpt-150.data-*"  # TF does not say which of several
    assert f"pstrain: warning: checkpoint file {named} is damaged (" in second.output
    assert f"pstrain: warning: resuming from {checkpoints / 'ckpt-125'} at step 125" in second.output
    assert "steps 125..150" in second.output
    assert not list(checkpoints.glob("*_temp*")), "leftovers of an interrupted save are removed"
    assert (checkpoints / "damaged" / data.name).exists(), "the damaged file is kept aside, not resumed from"
    assert_same_model_standalone(run_dir, reference)


def assert_same_model_standalone(run_dir: Path, reference: np.ndarray, steps: int = STEPS) -> None:
    records, done = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(steps)), "every step exactly once"
    assert done is not None and done["steps"] == steps
    np.testing.assert_allclose(predictions(run_dir, digits.eval_data()[0]), reference, atol=1e-4, rtol=0)


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of its own (tmpfs, 64 MiB), unmounted afterwards; skipped where mounting is refused."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        for path in mount.rglob("*"):  # what a test made immutable
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for inner in sorted((m for m in mounts if m.startswith(f"{mount}/")), reverse=True):  # a bind mount a test made
            subprocess.run(["umount", "--lazy", inner], capture_output=True)
        subprocess.run(["umount", "--lazy", str(mount)], capture_output=True)  # (a test may have unmounted it)


def break_disk(disk: Path, how: str, run_dir: Path) -> None:
    """Make `disk` refuse the run's writes: full, its checkpoints immutable, read-only, or gone."""
    if how == "full":
        fill(disk)
    elif how == "immutable":
        subprocess.run(["chattr", "+i", str(run_dir / "checkpoints")], check=True)
    elif how == "read-only":  # a read-only bind mount over checkpoints/ (a remount of the disk is refused while files are open)
        checkpoints = str(run_dir / "checkpoints")
        subprocess.run(["mount", "--bind", checkpoints, checkpoints], check=True)
        subprocess.run(["mount", "-o", "remount,ro,bind", checkpoints], check=True)
    else:  # gone: unmounted under the run (open files still write to it, new ones cannot be made)
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


# The one error line's start, after "pstrain: error: ", and its end.
BROKEN = {
    "full": ("no space left on device writing {run_dir}/", "; free space or use another --run-dir"),
    "immutable": (
        "permission denied writing {run_dir}/checkpoints/",  # ckpt-N, or the listing when the write came first
        "; make it writable (chmod u+w; chattr -i where it is immutable) or use another --run-dir",
    ),
    "read-only": ("read-only file system writing {run_dir}/checkpoints", "; remount it read-write or use another --run-dir"),
    "gone": (
        "the run dir is gone (unmounted or removed?) writing {run_dir}/",
        "; mount it again (then the same command resumes) or use another --run-dir",
    ),
}


def fill(disk: Path) -> None:
    """Take every free byte of `disk`."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", list(BROKEN))
def test_a_disk_that_refuses_writes_stops_with_one_line_and_the_last_checkpoint_intact(small_disk, how):
    """At step 40 the run dir's disk fills up, its checkpoints/ turns immutable (chattr +i), it is
    remounted read-only, or it is unmounted: one line (what, where, the fix), exit 1, no half-written
    checkpoint, the last complete one intact (where the disk is still there to read), nothing left."""
    run_dir, broken = small_disk / "run", []

    def break_at_step_40() -> bool:
        if not broken and step_lines(run_dir) >= 40:
            break_disk(small_disk, how, run_dir)
            broken.append(True)
        return bool(broken)

    args = ["launch", "--run-dir", str(run_dir), "--steps", "3000", "--checkpoint-every", "10"]
    result = run_pstrain(args, signal_when=break_at_step_40, send=None)
    assert broken, "the disk broke during the run"
    assert result.returncode == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("pstrain: error:")]
    assert len(errors) == 1, result.output
    start, end = BROKEN[how]
    assert errors[0].startswith("pstrain: error: " + start.format(run_dir=run_dir)), errors[0]
    assert errors[0].endswith(end), errors[0]
    assert "Traceback" not in result.output and "Exception in thread" not in result.output, result.output
    assert_no_orphans(result)
    if how == "gone":
        return  # nothing left to read
    subprocess.run(["chattr", "-i", str(run_dir / "checkpoints")], capture_output=True)  # (a read-only mount refuses)
    half = [p for p in run_dir.rglob("*") if "_temp" in p.name or p.name.endswith(".tmp")]
    if how in ("read-only", "immutable"):
        # A save that began before the break (step 40 is a checkpoint step) is cut short, and its
        # ckpt-N_temp cannot be removed from a read-only or immutable directory: only such a save is
        # left, and the next run's start removes it (chief/trainer.py: remove_partial_saves).
        assert all(p.parent.name.endswith("_temp") or p.name.endswith("_temp") for p in half), half
        if how == "immutable":  # writable again (chattr -i above): as the next run's start does
            remove_partial_saves(run_dir / "checkpoints")
            assert not [p for p in run_dir.rglob("*") if "_temp" in p.name or p.name.endswith(".tmp")]
    else:
        assert not half, "no half-written files"
    latest = tf.train.latest_checkpoint(str(run_dir / "checkpoints"))
    assert latest and int(latest.rsplit("-", 1)[1]) >= 30, latest
    reader = tf.train.load_checkpoint(latest)
    for name in reader.get_variable_to_shape_map():
        reader.get_tensor(name)  # every value reads back: the last checkpoint is intact


@pytest.mark.parametrize("how", ["full", "immutable", "read-only"])
@pytest.mark.parametrize("command", ["launch", "train --standalone"])
def test_a_run_dir_that_cannot_be_written_is_refused_before_anything_starts(small_disk, how, command):
    """Checked before any task starts: one line (what, where, the fix), exit 2, no process started."""
    run_dir = small_disk / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    break_disk(small_disk, how, run_dir)
    result = run_pstrain([*command.split(), "--run-dir", str(run_dir), "--steps", "20"])
    assert result.returncode == 2, result.output
    lines = result.output.strip().splitlines()
    what = BROKEN[how][0].split(" writing ")[0]
    where = str(run_dir) if how == "full" else f"{run_dir}/checkpoints"
    assert len(lines) == 1 and lines[0].startswith(f"pstrain: error: --run-dir: {what} writing {where}; "), lines
    assert BROKEN[how][1] in lines[0], lines
    assert not result.seen_pids, "nothing started"
