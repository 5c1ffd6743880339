"""`pstrain launch --engine ray` on a real Ray cluster of two nodes: the head in network namespace A
(10.251.6.1), a second node in B (10.251.6.2), each `ray start --block` bound to its namespace's
address only (small: 3 CPUs, 80 MB object store, no dashboard). The launcher runs on A, as a user
on the head would; the run dir is on the file system both nodes share here.

The job: the recommender with its user table sharded over 2 ps, workers spread over both nodes.
One test kills the worker process on B (restarted by its actor); one stops B's Ray mid-run (its
actors and tasks die with it; the run waits, B's Ray comes back, the run resumes); one runs `pstrain
stop` on B. The first two end equal to `pstrain train --standalone`; after each, no pstrain actor and no task process is left on
either node, and at the end no process either node's Ray started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from chief.jobs import recommender
from tests.helpers import (
    PSTRAIN,
    ROOT,
    Result,
    alive,
    assert_no_orphans,
    descendant_pids,
    lost_worker_warning,
    metrics,
    predictions,
    step_lines,
    task_pid,
    with_session_flags,
)
from tests.netns import netns_tier, two_hosts

pytestmark = netns_tier()
pytest.importorskip("ray", reason="the ray extra is not installed (deploy/install_ray.sh)")

from tests.ray_nodes import RAY_ENV, RayNode, assert_nothing_left  # noqa: E402 (after the skip)

JOB = ["--job", "chief.jobs.recommender:small", "--ps", "2", "--global-batch-size", "128"]
STEPS = 80
PORT = 6390  # the head's GCS, inside namespace A only


class TwoNodes:
    """The head on A and a node on B; `join_b` (re)starts B's Ray."""

    def __init__(self, a, b, tmp: Path):
        self.a, self.b, self.tmp = a, b, tmp
        self.address = f"{a.address}:{PORT}"
        argv = ["--head", f"--node-ip-address={a.address}", f"--port={PORT}", "--num-cpus=3", "--include-dashboard=false"]
        self.head = RayNode(argv + [f"--temp-dir={tmp / 'ray-a'}"], tmp / "head.out", prefix=a.command([]))
        self.nodes = [self.head]
        self.join_b()

    def join_b(self) -> RayNode:
        argv = [f"--address={self.address}", f"--node-ip-address={self.b.address}", "--num-cpus=3"]
        log = self.tmp / f"node-{len(self.nodes)}.out"
        node = RayNode(argv + [f"--temp-dir={self.tmp / 'ray-b'}"], log, prefix=self.b.command([]))
        self.nodes.append(node)
        return node

    @property
    def b_node(self) -> RayNode:
        return self.nodes[-1]


@pytest.fixture(scope="module")
def cluster():
    tmp = Path(tempfile.mkdtemp(prefix="pstray2", dir="/tmp"))  # Ray's socket paths must stay short
    nodes = None
    with two_hosts(tag=6) as (a, b):
        try:
            nodes = TwoNodes(a, b, tmp)
            yield nodes
        finally:
            for node in reversed(nodes.nodes if nodes else []):
                node.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    left = [p.pid for node in (nodes.nodes if nodes else []) for p in node.left()]
    assert not left, f"Ray processes left: {left}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    argv = PSTRAIN + ["train", "--standalone", *JOB, "--steps", str(STEPS), "--run-dir", str(run_dir)]
    result = subprocess.run(argv, cwd=ROOT, timeout=300)  # one process: killed and reaped if it hangs
    assert result.returncode == 0
    return predictions(run_dir, recommender.small.eval_data()[0])


def launch_on_a(nodes: TwoNodes, run_dir: Path, during, timeout: float = 240) -> Result:
    """`pstrain launch --engine ray --address HEAD` inside A; `during(output_so_far)` is called every
    0.1 s. Records every descendant pid; kills what remains on timeout (and fails)."""
    out = run_dir.parent / "launch.out"
    args = ["launch", "--engine", "ray", "--address", nodes.address, "--spread-workers", *JOB, "--steps", str(STEPS)]
    args += ["--checkpoint-every", "10", "--run-dir", str(run_dir)]
    argv, env = nodes.a.command(PSTRAIN + with_session_flags(args)), {**os.environ, **RAY_ENV}
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(out, "w"), stderr=subprocess.STDOUT)
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        seen |= descendant_pids([process.pid])
        during(out.read_text())
        time.sleep(0.1)
    if process.poll() is None:
        for p in alive(seen | {process.pid}):
            p.kill()
        process.wait()
        pytest.fail(f"pstrain launch did not finish within {timeout}s:\n{out.read_text()}")
    return Result(process.returncode, out.read_text(), seen)


def assert_equals_standalone(run_dir: Path, reference) -> None:
    records, done = metrics(run_dir)
    assert sorted({r["step"] for r in records}) == list(range(STEPS))
    assert all(r["aggregated"] == 2 for r in records), "every step aggregated N = 2 gradients"
    assert done is not None
    np.testing.assert_array_equal(predictions(run_dir, recommender.small.eval_data()[0]), reference)  # bit for bit


def placed_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("pstrain: Ray placed "))


def assert_spread(line: str, a: str, b: str) -> None:
    """Workers on both nodes (STRICT_SPREAD), each ps and the chief riding in a worker's bundle."""
    workers = line.partition("workers on ")[2]
    assert sorted(workers.split(", ")) == [a, b], line
    assert line.partition("ps on ")[2].partition(", workers")[0] in (f"{a}, {b}", f"{b}, {a}"), line


def test_a_sharded_table_on_two_nodes_equals_standalone_with_a_worker_killed_on_the_second(tmp_path, cluster, reference):
    run_dir = tmp_path / "run"
    killed: list[tuple[int, int]] = []

    def kill_the_worker_on_b(_output: str) -> None:
        if not killed and step_lines(run_dir) >= 20:
            on_b = [(i, task_pid(cluster.b_node.process.pid, "worker", i)) for i in (0, 1)]  # under B's raylet
            index, pid = next(((i, pid) for i, pid in on_b if pid), (None, None))
            if pid:
                psutil.Process(pid).send_signal(signal.SIGKILL)
                killed.append((index, pid))

    result = launch_on_a(cluster, run_dir, kill_the_worker_on_b)
    assert result.returncode == 0, result.output
    assert_spread(placed_line(result.output), cluster.a.address, cluster.b.address)
    assert killed, "the worker on B was killed mid-run"
    assert lost_worker_warning(f"worker-{killed[0][0]} exited (137)") in result.output, result.output
    assert "Traceback" not in result.output
    assert_equals_standalone(run_dir, reference)
    assert_no_orphans(result)
    assert_nothing_left(cluster.nodes)


def test_the_second_nodes_ray_stopped_mid_run_resumes_once_ray_places_it_again(tmp_path, cluster, reference):
    run_dir = tmp_path / "run"
    events: list[str] = []

    def stop_b_then_rejoin(output: str) -> None:
        if not events and step_lines(run_dir) >= 30:
            cluster.b_node.stop()  # B's Ray stopped: its raylet, its actors, the tasks under them
            events.append("stopped")
        elif events == ["stopped"] and "resuming from checkpoint step" in output:
            cluster.join_b()  # the node comes back: Ray can place the lost bundles again
            events.append("rejoined")

    result = launch_on_a(cluster, run_dir, stop_b_then_rejoin)
    a, b = cluster.a.address, cluster.b.address
    assert events == ["stopped", "rejoined"], result.output
    assert result.returncode == 0, result.output
    lost = [line for line in result.output.splitlines() if "(its Ray node)" in line]
    assert len(lost) == 1 and lost[0].startswith("pstrain: warning: lost ") and f" at {b}:" in lost[0], result.output
    assert "once Ray places it again (waiting up to 60s for room for 2 bundles, STRICT_SPREAD)" in lost[0]
    placed = [line for line in result.output.splitlines() if line.startswith("pstrain: Ray placed ")]
    assert len(placed) == 2, result.output
    for line in placed:
        assert_spread(line, a, b)
    assert "resumed" in (run_dir / "logs" / "chief-0.log").read_text()
    assert "Traceback" not in result.output
    assert_equals_standalone(run_dir, reference)
    assert_no_orphans(result)
    assert_nothing_left(cluster.nodes)


def test_pstrain_stop_from_the_second_node_checkpoints_and_leaves_nothing_on_either(tmp_path, cluster):
    """`pstrain stop --run-dir` run on B, as an operator on the second machine would (the run dir is
    shared; its control.json names the control plane on A and the token): a checkpoint, exit 0."""
    run_dir = tmp_path / "run"
    stopped: list[subprocess.CompletedProcess] = []

    def stop_from_b(output: str) -> None:
        said = f"watch it with: pstrain status --run-dir {run_dir}" in output
        if not stopped and said and step_lines(run_dir) >= 20:
            argv = PSTRAIN + ["stop", "--run-dir", str(run_dir)]
            stopped.append(subprocess.run(cluster.b.command(argv), cwd=ROOT, capture_output=True, text=True, timeout=60))

    result = launch_on_a(cluster, run_dir, stop_from_b)
    assert stopped and stopped[0].returncode == 0, stopped and stopped[0].stdout + stopped[0].stderr
    assert result.returncode == 0, result.output
    stop_lines = [line for line in result.output.splitlines() if line.startswith("pstrain: stopped by pstrain stop from ")]
    assert len(stop_lines) == 1 and "checkpoint saved" in stop_lines[0], result.output  # names the sender's hostname
    assert "stopped by pstrain stop from " in (run_dir / "logs" / "chief-0.log").read_text()  # the chief's log too
    assert not (run_dir / "control.json").exists(), "control.json outlives the launch"
    assert 20 <= len(metrics(run_dir)[0]) < STEPS
    assert sorted((run_dir / "checkpoints").glob("ckpt-*.index")), "a checkpoint to resume from"
    assert_no_orphans(result)
    assert_nothing_left(cluster.nodes)
