"""A run dir belongs to one run: a second run on it is refused naming the holder; a dead holder's lock is taken over."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.errors import ConfigError
from cluster.rundir import RunDir
from cluster.runlock import LOCK_NAME, Holder, RunDirLock, is_stale, refusal
from tests.helpers import ROOT, run_pstrain
from tests.system.test_bad_input import assert_one_line_error

HOLDER = Holder("node-a", 1234, 1_800_000_000.25, "pstrain launch", "/shared/runs/x")


@pytest.mark.pure
@pytest.mark.parametrize(
    "host, running_since, stale",
    [
        ("node-a", 1_800_000_000.25, False),  # its process runs here
        ("node-a", 1_800_000_000.26, False),  # the same start within the clock's tick
        ("node-a", None, True),  # no process with its pid
        ("node-a", 1_800_000_500.0, True),  # its pid now belongs to a later process
        ("node-b", None, False),  # on another machine: not judged from here
    ],
)
def test_is_stale(host, running_since, stale):
    assert is_stale(HOLDER, host, running_since) is stale


@pytest.mark.pure
def test_refusal_names_the_holder_and_how_to_stop_it():
    since = time.strftime("%H:%M:%S", time.localtime(HOLDER.create_time))
    assert refusal(Path("runs/x"), HOLDER) == (
        f"runs/x is in use by pstrain launch pid 1234 on host node-a since {since}; "
        "stop it (pstrain stop --run-dir /shared/runs/x) or use another --run-dir"
    )
    assert Holder.parse("{cut short") is None


def hold(run_dir: Path) -> subprocess.Popen:
    """Another process holding `run_dir` as a launcher would (the run dir whose control.json names its control plane)."""
    code = (
        "import sys, time; from cluster.rundir import RunDir; from cluster.runlock import RunDirLock\n"
        f"with RunDirLock(RunDir({str(run_dir)!r}), 'pstrain launch') as lock:\n"
        f"    lock.set_control({str(run_dir)!r}); print('held', flush=True); time.sleep(120)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


@pytest.mark.cluster
@pytest.mark.parametrize("command", [["launch"], ["train", "--standalone"]], ids=["launch", "standalone"])
def test_second_run_on_a_held_run_dir_is_refused_and_touches_nothing(tmp_path, command):
    run_dir = tmp_path / "run"
    holder = hold(run_dir)
    try:
        before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
        result = run_pstrain([*command, "--steps", "2", "--run-dir", str(run_dir)], timeout=120)
        after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    finally:
        holder.kill()
        holder.wait()
    assert_one_line_error(result, f"{run_dir} is in use by pstrain launch pid {holder.pid} on host {socket.gethostname()} since ")
    assert f"stop it (pstrain stop --run-dir {run_dir}) or use another --run-dir" in result.output
    assert after == before and not (run_dir / "control.token").exists(), "nothing written in the held run dir"
    assert not result.seen_pids, "no task started"


@pytest.mark.cluster
def test_a_dead_holders_lock_is_taken_over_saying_so(tmp_path):
    run_dir = tmp_path / "run"
    holder = hold(run_dir)
    holder.send_signal(signal.SIGKILL)  # dies holding it: the file stays, its flock goes with the process
    holder.wait()
    assert (run_dir / LOCK_NAME).exists()
    said: list[str] = []
    with RunDirLock(RunDir(run_dir), "pstrain train --standalone", say=said.append):
        assert len(said) == 1 and said[0].startswith(
            f"pstrain: warning: taking over {run_dir} from pstrain launch pid {holder.pid}"
        )
        assert said[0].endswith("which is no longer running")
        assert Holder.parse((run_dir / LOCK_NAME).read_text()).pid == os.getpid()
        with pytest.raises(ConfigError, match=f"in use by pstrain train --standalone pid {os.getpid()}"):
            RunDirLock(RunDir(run_dir), "pstrain launch").__enter__()  # a second holder in the same process is refused too
    assert not (run_dir / LOCK_NAME).exists(), "released at exit"


@pytest.mark.pure
def test_a_lock_recorded_by_another_machine_is_believed(tmp_path):
    """On a network file system another machine's flock may not be seen here: its record is enough."""
    (tmp_path / LOCK_NAME).write_text('{"host": "elsewhere", "pid": 7, "create_time": 1.0, "command": "pstrain launch"}')
    with pytest.raises(ConfigError, match=f"pid 7 on host elsewhere .* delete {tmp_path / LOCK_NAME}"):
        RunDirLock(RunDir(tmp_path), "pstrain launch").__enter__()
