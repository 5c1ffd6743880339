"""`pstrain launch --engine ray` on real Ray processes, all on 127.0.0.1: a Ray that pstrain starts
itself (the run equals `pstrain train --standalone` and leaves none of Ray's processes behind), Ctrl-C
and SIGTERM (a checkpoint, one line, nothing left), and an `--address` where nothing answers. A Ray
cluster joined by `--address` (a killed worker restarted, `pstrain stop`, a node lost) is proved on two
nodes: tests/system/test_ray_two_nodes.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
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
    with_session_flags,
)

pytest.importorskip("ray", reason="the ray extra is not installed (deploy/install_ray.sh)")
pytestmark = pytest.mark.cluster

from tests.ray_nodes import RAY_ENV as RAY_NODE_ENV  # noqa: E402 (after the skip)

STEPS = 300  # long enough that a `pstrain stop` (a process of its own) lands before the end
RAY_ENV = {**RAY_NODE_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray's one-machine mode: loopback only


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
    np.testing.assert_array_equal(predictions(run_dir, digits.eval_data()[0]), reference)  # bit for bit


def test_a_local_ray_trains_the_default_job_equal_to_standalone_and_leaves_nothing(tmp_path, reference):
    """No --address: pstrain starts Ray on 127.0.0.1 and stops every one of its processes at the end.
    Mid-run, `pstrain status --run-dir` finds the control plane through control.json (engine "ray")."""
    run_dir = tmp_path / "run"
    seen: dict = {}

    def status_once() -> bool:
        if step_lines(run_dir) >= 30 and (run_dir / "control.json").exists():
            seen["record"] = json.loads((run_dir / "control.json").read_text())
            argv = PSTRAIN + ["status", "--run-dir", str(run_dir), "--json"]
            seen["status"] = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
            return True
        return False

    result = run_pstrain(ray_args(run_dir, None), timeout=240, env=RAY_ENV, signal_when=status_once, send=None)
    assert result.returncode == 0, result.output
    assert seen["record"]["engine"] == "ray", seen
    assert seen["status"].returncode == 0, seen["status"].stderr
    assert json.loads(seen["status"].stdout)["state"] in ("training", "stopping"), seen["status"].stdout
    assert not (run_dir / "control.json").exists()
    assert "Ray placed chief on 127.0.0.1, ps on 127.0.0.1, workers on 127.0.0.1" in result.output
    assert "Traceback" not in result.output
    assert_equals_standalone(run_dir, reference)
    assert_no_orphans(result, within_s=20)  # Ray's head processes, its actors and the tasks


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
        PSTRAIN + with_session_flags(ray_args(run_dir, None)),
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
