"""Two machines for real: two network namespaces joined by a veth pair, one host each.

Host A runs `pstrain launch` (chief, ps, worker 0); host B runs `pstrain node --chief A:PORT`
(worker 1), exactly the recipe of docs/two-machines.md. Then the link between them is cut.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from chief.jobs import digits
from tests.helpers import (
    PSTRAIN,
    ROOT,
    Result,
    alive,
    assert_both_workers_each_step,
    assert_no_orphans,
    descendant_pids,
    metrics,
    predictions,
    run_pstrain,
    step_lines,
    with_session_flags,
)
from tests.netns import netns_tier, set_link, two_hosts
from tests.system.two_hosts import CONTROL_PORT, node_argv, write_two_host_job

pytestmark = netns_tier()


@dataclass
class TwoHostRun:
    launcher_code: int
    node_code: int
    launcher_output: str
    node_output: str
    statuses: list[dict] = field(default_factory=list)


def run_two_hosts(tmp_path: Path, a, b, steps: int, timeout: float, during=None) -> TwoHostRun:
    """Launcher on A, node on B; `during(elapsed_steps)` runs in the polling loop. Reaps everything."""
    run_dir = tmp_path / "run"
    config, token = write_two_host_job(
        tmp_path, {"a": a, "b": b}, cluster={"heartbeat_timeout": timeout}, steps=steps, checkpoint_every=20, run_dir=run_dir
    )
    outputs = [tmp_path / "launch.out", tmp_path / "node.out"]
    launch_argv = with_session_flags(["launch", "--config", str(config)])
    processes = [
        subprocess.Popen(host.command(PSTRAIN + argv), cwd=ROOT, stdout=open(out, "w"), stderr=subprocess.STDOUT)
        for host, argv, out in ((a, launch_argv, outputs[0]), (b, node_argv(a, token, tmp_path / "node"), outputs[1]))
    ]
    launcher, node = processes
    seen: set[int] = set()
    statuses: list[dict] = []
    try:
        deadline = time.monotonic() + 300
        while launcher.poll() is None and time.monotonic() < deadline:
            seen |= descendant_pids(p.pid for p in processes)
            if not statuses or statuses[-1].get("state") != "training":
                # Ask from host B, as an operator on the second machine would.
                argv = PSTRAIN + ["status", "--chief", f"{a.address}:{CONTROL_PORT}", "--token-file", str(token), "--json"]
                status = subprocess.run(b.command(argv), cwd=ROOT, capture_output=True, text=True, timeout=60)
                if status.returncode == 0:
                    statuses.append(json.loads(status.stdout))
            if during:
                during(step_lines(run_dir))
            time.sleep(0.2)
        node.wait(timeout=60)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
        left = alive(seen)
        for p in left:
            p.kill()
    assert not left, f"processes left running: {[p.pid for p in left]}"
    assert_no_orphans(Result(0, "", seen))
    return TwoHostRun(launcher.returncode, node.returncode, outputs[0].read_text(), outputs[1].read_text(), statuses)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free model for 120 steps (a standalone run equals a fault-free cluster run)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = run_pstrain(["train", "--standalone", "--run-dir", str(run_dir), "--steps", "120"])
    assert result.returncode == 0, result.output
    return predictions(run_dir, digits.eval_data()[0])


def assert_complete(run_dir: Path, steps: int, reference) -> None:
    records, done = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(steps))
    assert all(r["aggregated"] == 2 for r in records)
    assert done is not None
    np.testing.assert_allclose(predictions(run_dir, digits.eval_data()[0]), reference, atol=1e-4, rtol=0)


def test_training_across_two_hosts(tmp_path, reference):
    with two_hosts() as (a, b):
        run = run_two_hosts(tmp_path, a, b, steps=120, timeout=10)
        namespaces = (a.namespace, b.namespace)
    assert run.launcher_code == 0, run.launcher_output + run.node_output
    assert run.node_code == 0, run.node_output
    records, _ = metrics(tmp_path / "run")
    assert_both_workers_each_step(records, first_steps=(0,))  # both hosts' workers
    assert_complete(tmp_path / "run", 120, reference)
    training = [s for s in run.statuses if s["state"] == "training"]
    assert training, f"status never showed the cluster training: {run.statuses}"
    hosts = {row["task"]: row["host"] for row in training[-1]["tasks"]}
    assert hosts == {"chief:0": a.address, "ps:0": a.address, "worker:0": a.address, "worker:1": b.address}
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in namespaces), "the test removes its namespaces"


def cut_link(host, run_dir: Path, at_step: int, seconds: float, log: list):
    """A `during` callback: take host's link down once `at_step` steps are logged, for `seconds`."""

    def during(steps_done: int) -> None:
        if not log and steps_done >= at_step:
            set_link(host, up=False)
            log.append(("down", time.monotonic(), steps_done))
        elif len(log) == 1 and time.monotonic() - log[0][1] >= seconds:
            set_link(host, up=True)
            log.append(("up", time.monotonic(), step_lines(run_dir)))

    return during


def test_short_network_cut_stalls_and_resumes(tmp_path, reference):
    with two_hosts(tag=1) as (a, b):
        log: list = []
        during = cut_link(b, tmp_path / "run", at_step=30, seconds=3.0, log=log)
        run = run_two_hosts(tmp_path, a, b, steps=120, timeout=10, during=during)
    assert [event for event, *_ in log] == ["down", "up"], "the link was cut and restored mid-run"
    assert run.launcher_code == 0, run.launcher_output
    assert run.node_code == 0, run.node_output
    assert_complete(tmp_path / "run", 120, reference)


def test_long_network_cut_ends_with_error_and_a_checkpoint_to_resume(tmp_path, reference):
    with two_hosts(tag=2) as (a, b):
        log: list = []
        during = cut_link(b, tmp_path / "run", at_step=30, seconds=8.0, log=log)
        cut = run_two_hosts(tmp_path, a, b, steps=120, timeout=3, during=during)
        assert cut.launcher_code == 1, cut.launcher_output
        assert f"pstrain: error: lost worker:1 at {b.address}:2222: no heartbeat for 3s" in cut.launcher_output
        assert cut.node_code != 0, cut.node_output
        worker_log = (tmp_path / "node" / "worker-1.log").read_text()
        assert "worker:1: the control plane at" in worker_log and "unreachable" in worker_log, "B's task left by itself"
        assert "Traceback" not in cut.launcher_output
        checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("ckpt-*.index"))
        assert checkpoints, "an intact checkpoint to resume from"
        set_link(b, up=True)
        resumed = run_two_hosts(tmp_path, a, b, steps=120, timeout=3)
    assert resumed.launcher_code == 0, resumed.launcher_output
    assert "resumed" in (tmp_path / "run" / "logs" / "chief-0.log").read_text()
    assert_complete(tmp_path / "run", 120, reference)
