"""CPU per step, by role: where a run on a CPU-bound machine spends its cores, pstrain against TF1.

    python -m tests.benchmarks.cpu_split [--steps 3000] [--warmup 300] [--window 6]

Both train the embedding benchmark's job (tests/benchmarks/embeddings.py: a 1 M-row table and an MLP,
2 workers, 1 ps, global batch 128), one run after the other: pstrain launched as a user launches it,
then the TF1 SyncReplicasOptimizer recipe. Once a run is past `--warmup` steps, every one of its
processes' CPU time (user + system, psutil) and the run's step count are read at the start and the end
of a window of about `--window` seconds, opened and closed just as the step count moves (it moves a
block at a time). A role's figure is its CPU time in the window over the steps applied in it; `cores
busy` is all roles' CPU time over the window's wall time (2 cores: at most 2.0).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from cluster.forecast.measure import cpu_by_role
from tests.benchmarks.bench import PY, ROOT, env_for, stop_all
from tests.benchmarks.embeddings import JOBS
from tests.benchmarks.links import free_ports

PROGRESS_ENV = "BENCH_PROGRESS_FILE"  # TF1's worker 0 writes its step count there (tests/benchmarks/peers.py)


def next_count(steps: Callable[[], int], deadline: float) -> int:
    """Wait until the step count moves, then until it holds still for 2 ms (a block's lines are written
    one by one); returns it. Counts move in jumps (a block of K steps, TF1's every 50): a window opened
    and closed on a jump counts its steps exactly."""
    last = steps()
    while (now := steps()) == last:
        if time.monotonic() > deadline:
            raise RuntimeError("the run applied no step for too long: make --steps larger")
        time.sleep(0.002)
    while True:
        time.sleep(0.002)
        if (again := steps()) == now:
            return now
        now = again


def sample(processes: Callable[[], list[psutil.Process]], steps: Callable[[], int], warmup: int, window: float) -> dict:
    """Wait until `steps()` passes `warmup` (at most 300 s), then measure one window of about `window`
    seconds, opened and closed as the count moves."""
    deadline = time.monotonic() + 300
    while steps() < warmup:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the run did not reach step {warmup} in 300s")
        time.sleep(0.1)
    group = processes()
    first = next_count(steps, deadline)
    before, t0 = cpu_by_role(group, by_task=True), time.monotonic()
    time.sleep(window)
    last = next_count(steps, time.monotonic() + 60)
    after, t1 = cpu_by_role(group, by_task=True), time.monotonic()
    count = last - first
    per_step = {role: (after[role] - before[role]) * 1000 / count for role in after if role in before}
    busy = sum(after[role] - before[role] for role in per_step) / (t1 - t0)
    return {"ms_per_step": (t1 - t0) * 1000 / count, "cpu_ms_per_step": per_step, "cores_busy": busy}


def pstrain(steps: int, warmup: int, window: float) -> dict:
    run = Path(tempfile.mkdtemp(prefix="pstrain-cpu-")) / "run"
    argv = [PY, "-m", "cluster.cli", "launch", "--job", JOBS["1m"], "--steps", str(steps), "--checkpoint-every", "0"]
    argv += ["--global-batch-size", "128", "--workers", "2", "--ps", "1", "--run-dir", str(run)]
    launcher = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def applied() -> int:
        if launcher.poll() is not None:
            raise RuntimeError(f"pstrain ended (exit {launcher.returncode}) before the window; logs in {run / 'logs'}")
        try:
            return (run / "metrics.jsonl").read_text().count('"aggregated"')
        except FileNotFoundError:
            return 0

    try:
        root = psutil.Process(launcher.pid)
        return sample(lambda: [root, *root.children(recursive=True)], applied, warmup, window)
    finally:
        stop_all([launcher], grace_s=60)  # the launcher stops and reaps its tasks first


def tf1(steps: int, warmup: int, window: float) -> dict:
    progress = Path(tempfile.mkdtemp(prefix="tf1-cpu-")) / "steps"
    addresses = free_ports(3)
    cluster = {"ps": addresses[:1], "worker": addresses[1:]}
    argv = [PY, "-m", "tests.benchmarks.embeddings", "tf1", "1m", "128", str(steps)]
    group = [env_for(cluster, "worker", i) for i in range(2)] + [env_for(cluster, "ps", 0)]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    processes: list[subprocess.Popen] = []

    def applied() -> int:
        if processes[0].poll() is not None:
            raise RuntimeError("TF1's worker 0 ended before the window: make --steps larger")
        try:
            return int(progress.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    try:
        for env in group:  # started inside the try: one that fails to start still has the others stopped
            processes.append(subprocess.Popen(argv, cwd=ROOT, env={**env, PROGRESS_ENV: str(progress)}, **quiet))
        return sample(lambda: [psutil.Process(p.pid) for p in processes], applied, warmup, window)
    finally:
        stop_all(processes)


def table(runs: dict[str, dict]) -> str:
    roles = sorted({role for run in runs.values() for role in run["cpu_ms_per_step"]}, key=lambda r: (r != "chief", r))
    lines = ["| role | " + " | ".join(f"{peer} CPU ms/step" for peer in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for role in roles:
        cells = [f"{run['cpu_ms_per_step'][role]:.2f}" if role in run["cpu_ms_per_step"] else "—" for run in runs.values()]
        lines.append(f"| {role} | " + " | ".join(cells) + " |")
    lines.append("| all roles | " + " | ".join(f"{sum(run['cpu_ms_per_step'].values()):.2f}" for run in runs.values()) + " |")
    lines.append("| wall ms/step | " + " | ".join(f"{run['ms_per_step']:.2f}" for run in runs.values()) + " |")
    lines.append("| cores busy | " + " | ".join(f"{run['cores_busy']:.2f}" for run in runs.values()) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000, help="steps per run (the window must end before the run)")
    parser.add_argument("--warmup", type=int, default=300, help="steps before the window opens")
    parser.add_argument("--window", type=float, default=6.0, help="seconds measured")
    args = parser.parse_args()
    print(f"# {os.cpu_count()} cores; embeddings 1m, 2 workers, 1 ps, batch 128; {args.window:g}s after step {args.warmup}")
    runs = {"pstrain": pstrain(args.steps, args.warmup, args.window), "TF1": tf1(args.steps, args.warmup, args.window)}
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
