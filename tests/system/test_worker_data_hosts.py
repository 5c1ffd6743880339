"""Each machine reads the job's files from its own disk: a copy that differs, or is missing, on one
machine is refused in one line naming the worker and its host, not trained on and not a hang.

Two network namespaces as two hosts (tests/netns.py). Host A runs `pstrain launch` in directory a/,
host B runs `pstrain node` in directory b/; the job (tests.jobs.data_jobs:relative_npy) names
`data/x.npy`, which each process resolves against its own working directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from cluster.rundir import RunDir
from tests.helpers import PSTRAIN, ROOT, Result, alive, assert_no_orphans, descendant_pids, with_session_flags
from tests.jobs.data_jobs import write_relative_npy
from tests.netns import netns_tier, two_hosts
from tests.system.two_hosts import node_argv, write_two_host_job

pytestmark = netns_tier()


def run_with_b_data(tmp_path: Path, tag: int, b_seed: int | None) -> tuple[int, str]:
    """Launcher on A (its data from seed 1), node on B (seed `b_seed`, None: no data); returns A's exit and output."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    write_relative_npy(a_dir, seed=1)
    b_dir.mkdir()
    if b_seed is not None:
        write_relative_npy(b_dir, seed=b_seed)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with two_hosts(tag=tag) as (a, b):
        job = {"job": "tests.jobs.data_jobs:relative_npy", "steps": 40, "global_batch_size": 16, "run_dir": tmp_path / "run"}
        config, token = write_two_host_job(tmp_path, {"a": a, "b": b}, **job)
        node = node_argv(a, token, tmp_path / "node")
        out = [open(tmp_path / "launch.out", "w"), open(tmp_path / "node.out", "w")]
        launch_argv = with_session_flags(["launch", "--config", str(config)])
        processes = [
            subprocess.Popen(host.command(PSTRAIN + argv), cwd=cwd, env=env, stdout=o, stderr=subprocess.STDOUT)
            for host, argv, cwd, o in (
                (a, launch_argv, a_dir, out[0]),
                (b, node, b_dir, out[1]),
            )
        ]
        seen: set[int] = set()
        try:
            deadline = time.monotonic() + 240
            while processes[0].poll() is None and time.monotonic() < deadline:
                seen |= descendant_pids(p.pid for p in processes)
                time.sleep(0.2)
            processes[1].wait(timeout=60)
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for p in alive(seen):
                p.kill()
            for o in out:
                o.close()
    assert_no_orphans(Result(0, "", seen))
    return processes[0].returncode, (tmp_path / "launch.out").read_text()


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("pstrain: error:")]


def test_different_data_on_one_machine_is_refused_in_one_line(tmp_path):
    code, output = run_with_b_data(tmp_path, tag=5, b_seed=2)
    assert code == 2, output
    [line] = error_lines(output)
    assert line.startswith("pstrain: error: worker 1 (10.251.5.2:2222): its training data differs from the chief's"), line
    assert "different content" in line and "Traceback" not in output
    records = RunDir(tmp_path / "run").read_metrics()
    assert all(1 not in r.get("workers", []) for r in records), "no gradient from worker 1's data was applied"


def test_missing_file_on_one_machine_is_one_line_naming_host_and_path(tmp_path):
    code, output = run_with_b_data(tmp_path, tag=6, b_seed=None)
    assert code == 2, output
    [line] = error_lines(output)
    assert re.match(r"pstrain: error: worker 1 \(10\.251\.6\.2:2222\): data file data/[xy]\.npy not found;", line), line
    assert "Traceback" not in output
