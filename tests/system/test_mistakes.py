"""A newcomer's mistakes (issue 36), each one line naming the field and the fix, exit 2, no traceback,
nothing started and nothing left running: a sweep of bad inputs over launch, train, status, stop and
doctor, and run dirs that cannot be used (a file, under a file, read-only, a full disk)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import assert_no_orphans, run_pstrain

pytestmark = pytest.mark.cluster

# (argv with {tmp} for the test's directory, the start of the one error line after "pstrain: error: ")
SWEEP = [
    (["launch", "--run-dir", "{tmp}/a-file"], "--run-dir: {tmp}/a-file is a file, not a directory"),
    (["train", "--standalone", "--run-dir", "{tmp}/a-file"], "--run-dir: {tmp}/a-file is a file, not a directory"),
    (["launch", "--run-dir", "{tmp}/a-file/run"], "--run-dir: {tmp}/a-file/run is under {tmp}/a-file, which is a file"),
    (["train", "--standalone", "--run-dir", "{tmp}/a-file/run"], "--run-dir: {tmp}/a-file/run is under {tmp}/a-file"),
    (
        ["launch", "--job", "chief/jobs/digits.py"],
        "train.job: 'chief/jobs/digits.py' is a file path; give the module form, e.g. --job chief.jobs.digits",
    ),
    (["train", "--standalone", "--job", "./chief/jobs/digits.py"], "train.job: './chief/jobs/digits.py' is a file path"),
    (["launch", "--job", "no_such_pkg.job"], "train.job: module 'no_such_pkg.job' not found"),
    (["launch", "--workers", "0"], "cluster.workers: must be >= 1, got 0"),
    (["launch", "--steps", "-5"], "train.steps: must be >= 1, got -5"),
    (["launch", "--global-batch-size", "63"], "train.global_batch_size: 63 does not split evenly over 2 aggregated gradients"),
    (["launch", "--shuffle", "random"], "train.shuffle: expected 'permutation' or 'index_shuffle'"),
    (["launch", "--eval-every", "weekly"], "pstrain launch: argument --eval-every: invalid K steps or 'epoch' value: 'weekly'"),
    (["launch", "--workers", "two"], "pstrain launch: argument --workers: invalid int value: 'two'; see pstrain launch --help"),
    (["lunch"], "argument command: invalid choice: 'lunch'"),  # the program named once
    (["train", "--standalone", "--epochs", "2", "--steps", "5"], "train.steps and train.epochs: give one of them"),
    (["launch", "--config", "{tmp}/missing.toml"], "--config: file {tmp}/missing.toml not found"),
    (["status"], "pstrain status: give --run-dir DIR (the run's directory), or --chief HOST:PORT with --token-file"),
    (
        ["stop", "--run-dir", "{tmp}/empty", "--chief", "127.0.0.1:1"],
        "pstrain stop: give --run-dir DIR or --chief HOST:PORT, not both",
    ),
    (["status", "--run-dir", "{tmp}/empty"], "--run-dir: {tmp}/empty has no control.json: no pstrain launch is serving"),
    (["stop", "--run-dir", "{tmp}/nowhere"], "--run-dir: {tmp}/nowhere is not a directory"),
    (["doctor", "--run-dir", "{tmp}/empty"], "--run-dir: {tmp}/empty has no control.json"),
    (["status", "--run-dir", "{tmp}/junk"], "--run-dir: cannot read {tmp}/junk/control.json"),
    (["status", "--chief", "nohost"], "--chief: expected 'host:port', got 'nohost'"),
]


def assert_one_line_refusal(result, expected: str) -> None:
    assert result.returncode == 2, result.output
    assert "Traceback" not in result.output, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pstrain: error: {expected}"), result.output


@pytest.fixture
def scene(tmp_path):
    (tmp_path / "a-file").write_text("not a directory\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "control.json").write_text("not json\n")
    return tmp_path


@pytest.mark.parametrize("argv, expected", SWEEP, ids=[" ".join(a)[:60] for a, _ in SWEEP])
def test_each_mistake_is_one_line_exit_2_and_starts_nothing(scene, argv, expected):
    env = {k: v for k, v in os.environ.items() if k != "PSTRAIN_TOKEN"}
    result = run_pstrain([a.format(tmp=scene) for a in argv], timeout=60, env=env)
    assert_one_line_refusal(result, expected.format(tmp=scene))
    assert not result.seen_pids, "a refused command starts no process"
    assert_no_orphans(result)
    assert sorted(p.name for p in scene.iterdir()) == ["a-file", "empty", "junk"], "nothing written beside the inputs"


@contextlib.contextmanager
def mounted_tmpfs(path: Path, options: str):
    """A real tmpfs at `path` (as root); skips where it cannot be mounted."""
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("command", [["launch"], ["train", "--standalone"]], ids=["launch", "standalone"])
def test_a_read_only_run_dir_is_one_line(tmp_path, command):
    """Root writes anywhere a mode bit forbids: a read-only mount is what stops it."""
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        result = run_pstrain([*command, "--run-dir", str(ro / "run"), "--steps", "2"], timeout=60)
        assert_one_line_refusal(result, f"--run-dir: read-only file system writing {ro}; remount it read-write or use another")
        assert not result.seen_pids
        assert not (ro / "run").exists()


@pytest.mark.parametrize("command", [["launch"], ["train", "--standalone"]], ids=["launch", "standalone"])
def test_a_full_disk_is_one_line(tmp_path, command):
    with mounted_tmpfs(tmp_path / "full", "size=256k") as full:
        with contextlib.suppress(OSError), open(full / "filler", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
        result = run_pstrain([*command, "--run-dir", str(full / "run"), "--steps", "2"], timeout=60)
        assert result.returncode == 2 and "Traceback" not in result.output, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pstrain: error: --run-dir: "), result.output
        assert "No space left on device" in lines[0] or "free" in lines[0], result.output
        assert not result.seen_pids
