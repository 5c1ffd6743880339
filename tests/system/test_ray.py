"""`pstrain launch --engine ray` on real Ray processes, all on 127.0.0.1.

One Ray head (`ray start --head --block`, loopback only, no dashboard) serves the module's runs that
join it with `--address`; one run starts its own Ray and must leave none of its processes behind.
Each run equals `pstrain train --standalone`; a killed worker is restarted by its actor; `pstrain
stop`, Ctrl-C and SIGTERM checkpoint and stop; no task process and no pstrain actor outlives a run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from chief.jobs import digits
from cluster.launch.ports import free_port
from tests.helpers import (
    PSTRAIN,
    ROOT,
    Result,
    alive,
    assert_no_orphans,
    descendant_pids,
    metrics,
    predictions,
    run_pstrain,
    step_lines,
    task_pid,
)

pytest.importorskip("ray", reason="the ray extra is not installed (pip install .[ray])")
pytestmark = pytest.mark.cluster

from tests.ray_nodes import RAY_ENV as RAY_NODE_ENV  # noqa: E402 (after the skip)
from tests.ray_nodes import RayNode, assert_nothing_left  # noqa: E402

STEPS = 300  # long enough that a `pstrain stop` (a process of its own) lands before the end
RAY_ENV = {**RAY_NODE_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray's one-machine mode: loopback only


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head --block` on 127.0.0.1 (4 CPUs, no dashboard); stopped, and reaped by pid, at the end."""
    temp_dir = tempfile.mkdtemp(prefix="pstray", dir="/tmp")  # Ray's socket paths must stay short
    port = free_port("127.0.0.1")
    argv = ["--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=4", "--include-dashboard=false"]
    head = RayNode(argv + [f"--temp-dir={temp_dir}"], Path(temp_dir) / "head.out", env=RAY_ENV)
    try:
        yield head, f"127.0.0.1:{port}"
    finally:
        head.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not head.left(), f"Ray processes left: {[p.pid for p in head.left()]}"


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
            pid = task_pid(head.process.pid, "worker", 1)  # the task runs under its actor, under Ray's raylet
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
    assert_nothing_left([head])


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
    assert_nothing_left([head])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_checkpoints_stops_and_leaves_nothing(tmp_path, sig):
    """SIGINT to the launcher's whole process group, as a terminal's Ctrl-C sends it (Ray's processes
    of the Ray that pstrain started share the group), or SIGTERM to the launcher: one line, a
    checkpoint, exit 128+N, and no process of the run, Ray's own included, left. (Ray blocks SIGINT
    in its processes, so the chief under an actor starts with it blocked; and `ray.init` replaces
    the launcher's SIGTERM handler.)"""
    run_dir = tmp_path / "run"
    out = tmp_path / "launch.out"
    launcher = subprocess.Popen(
        PSTRAIN + ray_args(run_dir, None),
        cwd=ROOT,
        env={**os.environ, **RAY_ENV},
        stdout=open(out, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a group of its own, as a shell gives a foreground job
    )
    seen: set[int] = set()
    deadline = time.monotonic() + 240
    sent = False
    while launcher.poll() is None and time.monotonic() < deadline:
        seen |= descendant_pids([launcher.pid])
        if not sent and step_lines(run_dir) >= 30:
            os.killpg(launcher.pid, sig) if sig == signal.SIGINT else launcher.send_signal(sig)
            sent = True
        time.sleep(0.1)
    if launcher.poll() is None:
        for p in alive(seen | {launcher.pid}):
            p.kill()
        launcher.wait()
        pytest.fail(f"pstrain launch did not end within 240s:\n{out.read_text()}")
    output = out.read_text()
    assert sent, output
    assert launcher.returncode == 128 + sig, output
    stopped = [line for line in output.splitlines() if line.startswith("pstrain: stopped")]
    cause = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert len(stopped) == 1 and stopped[0].startswith(f"pstrain: stopped by {cause} after step "), output
    assert "checkpoint saved" in stopped[0], output
    assert "Traceback" not in output and "error" not in output, output
    assert 30 <= len(metrics(run_dir)[0]) < STEPS
    assert sorted((run_dir / "checkpoints").glob("ckpt-*.index")), "a checkpoint to resume from"
    assert_no_orphans(Result(launcher.returncode, output, seen), within_s=20)


def test_an_address_where_nothing_answers_is_refused_at_once_in_one_line(tmp_path):
    port = free_port("127.0.0.1")
    started = time.monotonic()
    result = run_pstrain(ray_args(tmp_path / "run", f"127.0.0.1:{port}"), timeout=60, env=RAY_ENV)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.output
    assert result.output.strip().splitlines() == [
        f"pstrain: error: --address: nothing answers at 127.0.0.1:{port} (Connection refused); give the Ray head's "
        f"HOST:PORT (`ray start --head --port={port}` prints it), or leave --address out to start a local Ray"
    ], result.output
    assert elapsed < 15, f"took {elapsed:.1f}s (Ray's own connect retries for 20s)"
    assert_no_orphans(result)
