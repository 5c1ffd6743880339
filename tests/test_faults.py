"""Faults on a real local cluster: each run must end with the same model as a fault-free run.

The reference is the standalone run (tests/test_local_cluster.py proves a fault-free cluster run
equals it), with the same job, seed, steps and global batch.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import numpy as np
import pytest

from chief.jobs import digits
from tests.helpers import assert_no_orphans, kill_task_when, metrics, predictions, run_pstrain

pytestmark = pytest.mark.cluster  # starts real processes (not in the fast tier)

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


def test_worker_killed_training_goes_on_and_the_worker_rejoins(tmp_path, references):
    steps = 600  # long enough after the kill for the restarted worker (a new TF process) to rejoin
    run_dir, killed = tmp_path / "run", []
    kill = kill_task_when(run_dir, "worker", 1, 30, killed)
    result = run_pstrain(launch_args(run_dir, steps), signal_when=kill, send=None)
    assert killed, "the worker was killed during the run"
    assert result.returncode == 0, result.output
    assert "worker-1 exited with code 137; restarting" in result.output
    assert (run_dir / "logs" / "worker-1.log").read_text().count("registered with the control plane") == 2
    records, _ = metrics(run_dir)
    assert any(1 in r["workers"] for r in records[40:]), "the restarted worker contributes again"
    assert_same_model(run_dir, references(steps), steps)
    assert_no_orphans(result)


@pytest.mark.parametrize("num_ps", [1, 2], ids=["one-ps", "two-ps-sharded"])
def test_ps_killed_cluster_restarts_it_and_recomputes_lost_steps(tmp_path, reference, num_ps):
    """With 2 ps the last one is killed: it holds a shard of the dense kernel."""
    run_dir, killed, victim = tmp_path / "run", [], num_ps - 1
    args = [*launch_args(run_dir), "--ps", str(num_ps)]
    result = run_pstrain(args, signal_when=kill_task_when(run_dir, "ps", victim, 40, killed), send=None)
    assert killed
    assert result.returncode == 0, result.output
    assert f"ps-{victim} exited with code 137; restarting" in result.output
    assert "restarting the chief to resume from its checkpoint" in result.output
    assert "resumed" in (run_dir / "logs" / "chief-0.log").read_text() or "steps 25.." in result.output
    assert_same_model(run_dir, reference)
    assert_no_orphans(result)


def test_chief_killed_same_command_resumes(tmp_path, reference):
    run_dir, killed = tmp_path / "run", []
    first = run_pstrain(launch_args(run_dir), signal_when=kill_task_when(run_dir, "chief", 0, 60, killed), send=None)
    assert killed
    assert first.returncode == 128 + signal.SIGKILL, first.output
    assert_no_orphans(first, within_s=10)
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


@pytest.mark.parametrize("how", ["truncated", "garbled"])
def test_damaged_newest_checkpoint_resumes_from_the_one_before(tmp_path, how):
    """The newest checkpoint's data file is damaged after a finished run: the same command again says
    which file is bad, resumes from the previous checkpoint, and ends with the same model."""
    run_dir = tmp_path / "run"
    args = ["train", "--standalone", "--run-dir", str(run_dir), "--steps", str(STEPS), "--checkpoint-every", "25"]
    first = run_pstrain(args)
    assert first.returncode == 0, first.output
    reference = predictions(run_dir, digits.eval_data()[0])
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("*.index")) == ["ckpt-100.index", "ckpt-125.index", "ckpt-150.index"]
    data = next(checkpoints.glob("ckpt-150.data-*"))
    damage(data, how)
    (checkpoints / "ckpt-175_temp").mkdir()  # what a save cut short leaves
    (checkpoints / "ckpt-175_temp" / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"\0" * 1000)
    second = run_pstrain(args)
    assert second.returncode == 0, second.output
    assert f"pstrain: warning: checkpoint file {data} is damaged (" in second.output
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
