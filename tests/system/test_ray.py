"""`pstrain launch --engine ray` on real Ray processes, all on 127.0.0.1.

One Ray head (`ray start --head --block`, loopback only, no dashboard) serves the module's runs that
join it with `--address`; one run starts its own Ray and must leave none of its processes behind.
Each run equals `pstrain train --standalone`; a killed worker is restarted by its actor; `pstrain
stop` checkpoints and stops; no task process and no pstrain actor outlives a run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from chief.jobs import digits
from cluster.launch.ports import free_port
from tests.helpers import assert_no_orphans, metrics, predictions, run_pstrain, step_lines, task_pid

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install .[ray])")
pytestmark = pytest.mark.cluster

STEPS = 300  # long enough that a `pstrain stop` (a process of its own) lands before the end
RAY = str(Path(sys.executable).parent / "ray")
# Ray's one-machine mode (loopback only), and a token of the test's own for Ray's token authentication
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(16),
}


def start_ray_head(temp_dir: str, cpus: int) -> tuple[subprocess.Popen, str]:
    """`ray start --head --block` on 127.0.0.1; returns the process (its children are Ray's) and address."""
    port = free_port("127.0.0.1")
    argv = [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-cpus={cpus}"]
    argv += ["--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    env = {**os.environ, **RAY_ENV}
    head = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = head.stdout.readline()
        lines.append(line)
        if "Ray runtime started" in line or not line:
            break
    if "Ray runtime started" not in "".join(lines):
        head.kill()
        head.wait()
        pytest.fail("ray start failed:\n" + "".join(lines))
    return head, f"127.0.0.1:{port}"


def stop_ray(head: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` stops the Ray processes it started; then nothing of it is left."""
    family = {p.pid for p in psutil.Process(head.pid).children(recursive=True)}
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait()
    for pid in family:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="pstray", dir="/tmp")  # Ray's socket paths must stay short
    head, address = start_ray_head(temp_dir, cpus=4)
    try:
        yield head, address
    finally:
        stop_ray(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = run_pstrain(["train", "--standalone", "--run-dir", str(run_dir), "--steps", str(STEPS)])
    assert result.returncode == 0, result.output
    return predictions(run_dir, digits.eval_data()[0])


def ray_args(run_dir: Path, address: str | None) -> list[str]:
    args = ["launch", "--engine", "ray", "--run-dir", str(run_dir), "--steps", str(STEPS), "--checkpoint-every", "20"]
    return args + (["--address", address] if address else [])


def assert_equals_standalone(run_dir: Path, reference) -> None:
    records, done = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["aggregated"] == 2 for r in records), "every step aggregated N = 2 gradients"
    assert done is not None
    np.testing.assert_allclose(predictions(run_dir, digits.eval_data()[0]), reference, atol=1e-4, rtol=0)


def pstrain_on_ray(head: subprocess.Popen) -> list[psutil.Process]:
    """What pstrain left under the Ray head: its TaskHost actors and any task process (a TF_CONFIG)."""
    left = []
    for p in psutil.Process(head.pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and ("TaskHost" in p.name() or "TF_CONFIG" in p.environ()):
                left.append(p)
        except psutil.Error:
            pass
    return left


def assert_nothing_left_on(head: subprocess.Popen, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while pstrain_on_ray(head) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = pstrain_on_ray(head)
    assert not left, f"left on the Ray node: {[(p.pid, p.name()) for p in left]}"


def test_a_local_ray_trains_the_default_job_equal_to_standalone_and_leaves_nothing(tmp_path, reference):
    """No --address: pstrain starts Ray on 127.0.0.1 and stops every one of its processes at the end."""
    run_dir = tmp_path / "run"
    result = run_pstrain(ray_args(run_dir, None), timeout=240, env=RAY_ENV)
    assert result.returncode == 0, result.output
    assert "Ray placed chief on 127.0.0.1, ps on 127.0.0.1, workers on 127.0.0.1" in result.output
    assert "Traceback" not in result.output
    assert_equals_standalone(run_dir, reference)
    assert_no_orphans(result, within_s=20)  # Ray's head processes, its actors and the tasks


def test_a_killed_worker_is_restarted_and_the_run_ends_with_the_fault_free_model(tmp_path, ray_head, reference):
    head, address = ray_head
    run_dir = tmp_path / "run"
    killed: list[int] = []
    found: list[int] = []

    def kill_worker() -> bool:
        if not found:
            pid = task_pid(head.pid, "worker", 1)  # the task runs under its actor, under Ray's raylet
            found.extend([pid] if pid else [])
        elif step_lines(run_dir) >= 30 and not killed:
            os.kill(found[0], signal.SIGKILL)
            killed.append(found[0])
        return False

    result = run_pstrain(ray_args(run_dir, address), timeout=240, signal_when=kill_worker, send=None, env=RAY_ENV)
    assert result.returncode == 0, result.output
    assert killed, "worker 1 was killed mid-run"
    assert "worker-1 exited (137); restarting (1 of 3)" in result.output
    assert_equals_standalone(run_dir, reference)
    assert_no_orphans(result)
    assert_nothing_left_on(head)


def test_pstrain_stop_checkpoints_and_stops_every_task(tmp_path, ray_head):
    head, address = ray_head
    run_dir = tmp_path / "run"
    stopped: list[subprocess.CompletedProcess] = []

    def stop_once_training() -> bool:
        if step_lines(run_dir) >= 30 and not stopped:
            holder = json.loads((run_dir / "pstrain.lock").read_text())
            argv = [sys.executable, "-m", "cluster.cli", "stop", "--chief", holder["control"]]
            argv += ["--token-file", str(run_dir / "control.token")]
            stopped.append(subprocess.run(argv, capture_output=True, text=True, timeout=60))
        return False

    result = run_pstrain(ray_args(run_dir, address), timeout=240, signal_when=stop_once_training, send=None, env=RAY_ENV)
    assert stopped and stopped[0].returncode == 0, stopped and stopped[0].stderr
    assert result.returncode == 0, result.output  # a commanded stop that checkpointed (docs/faults.md)
    assert "stopped by pstrain stop from" in result.output and "checkpoint" in result.output, result.output
    assert 30 <= len(metrics(run_dir)[0]) < STEPS
    assert sorted((run_dir / "checkpoints").glob("ckpt-*.index")), "a checkpoint to resume from"
    assert_no_orphans(result)
    assert_nothing_left_on(head)
