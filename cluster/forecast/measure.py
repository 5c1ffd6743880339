"""A short measured run of the user's job: `pstrain launch` in a throwaway run dir, and the CPU each
role spends per applied step over a window of its steady state (psutil), with the step time.

The window opens and closes just as the step count in `metrics.jsonl` moves (it moves a block of K
steps at a time), so it counts its steps exactly. The launcher is always stopped and reaped, and it
stops and reaps its tasks.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from cluster.errors import ConfigError
from cluster.forecast.model import Observation
from cluster.rundir import RunDir
from cluster.tfconfig import named_task, tf_config_text


def role_of(process: psutil.Process, by_task: bool = False) -> str:
    """`chief`, `ps`, `worker` (by_task: `ps 0`, `worker 1`, ...) from a process's command line and its
    TF_CONFIG (read through cluster/tfconfig.py); `launcher` for a process without one, `gone` for one
    that has ended."""
    try:
        command = " ".join(process.cmdline()[1:3])
        task = named_task(tf_config_text(process.environ()))
    except psutil.Error:
        return "gone"
    if "-m chief" in command:
        return "chief"
    if task is None:
        return "launcher"
    return f"{task[0]} {task[1]}" if by_task else task[0]


def cpu_by_role(processes: list[psutil.Process], by_task: bool = False) -> dict[str, float]:
    """CPU seconds (user + system) so far, summed by role (`role_of`); the one CPU sampler of `pstrain
    plan` and the benchmarks (tests/benchmarks/cpu_split.py)."""
    out: dict[str, float] = {}
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        role = role_of(process, by_task)
        out[role] = out.get(role, 0.0) + times.user + times.system
    return out


def next_count(steps: Callable[[], int], deadline: float) -> int:
    """Wait until the step count moves, then until it holds still for 5 ms; returns it."""
    last = steps()
    while (now := steps()) == last:
        if time.monotonic() > deadline:
            raise ConfigError("pstrain plan: the measured run applied no step for too long; give more --measure-steps")
        time.sleep(0.002)
    while True:
        time.sleep(0.005)
        if (again := steps()) == now:
            return now
        now = again


def launch_argv(job: str, workers: int, ps: int, batch: int, steps: int, run_dir: RunDir, dense: str = "ps") -> list[str]:
    argv = [sys.executable, "-m", "cluster.cli", "launch", "--job", job, "--workers", str(workers), "--ps", str(ps)]
    argv += ["--global-batch-size", str(batch), "--steps", str(steps), "--checkpoint-every", "0", "--run-dir", str(run_dir.path)]
    return argv + ["--dense", dense]


def measure(
    job: str, workers: int, ps: int, batch: int, steps: int, warmup: int, log: Path | None = None, dense: str = "ps"
) -> Observation:
    """Launch the job on this machine with train.dense = `dense` and measure its steps after `warmup`
    until the run ends.

    Raises ConfigError (one line) when the run fails or ends before a window could be measured."""
    with tempfile.TemporaryDirectory(prefix="pstrain-plan-") as tmp:
        run_dir = RunDir(Path(tmp) / "run")  # the measured run's layout, made where its directory is
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
        launched = time.monotonic()
        launcher = subprocess.Popen(launch_argv(job, workers, ps, batch, steps, run_dir, dense), stdout=out, stderr=out)
        try:
            return dataclasses.replace(_window(launcher, launched, run_dir, workers, ps, batch, steps, warmup), dense=dense)
        finally:
            stop(launcher)
            if log:
                out.close()


def _window(
    launcher: subprocess.Popen, launched: float, run_dir: RunDir, workers: int, ps: int, batch: int, steps: int, warmup: int
) -> Observation:
    """Snapshot every role's CPU each time the step count moves; the window runs from the first
    snapshot at or past `warmup` to the last one. The start-up runs from `launched` (time.monotonic)
    to the first applied step seen (polled every 10 ms)."""
    metrics = run_dir.metrics

    def applied() -> int:
        try:
            count = metrics.read_text().count('"aggregated"')
        except FileNotFoundError:
            count = 0
        if count < steps and launcher.poll() is not None:  # (a run that ended has applied all its steps)
            what = f"the measured run ({workers} workers, {ps} ps) exited with {launcher.returncode}"
            raise ConfigError(f"pstrain plan: {what}; --log FILE keeps its output")
        return count

    deadline = time.monotonic() + 300
    while applied() == 0:
        if time.monotonic() > deadline:
            raise ConfigError("pstrain plan: the measured run applied no step in 300 s")
        time.sleep(0.01)
    startup_s = time.monotonic() - launched
    while applied() < warmup:
        if time.monotonic() > deadline:
            raise ConfigError(f"pstrain plan: the measured run did not reach step {warmup} in 300 s")
        time.sleep(0.05)
    root = psutil.Process(launcher.pid)
    group = [root, *root.children(recursive=True)]
    snapshots = []
    count = next_count(applied, deadline)
    while True:
        snapshots.append((count, cpu_by_role(group), time.monotonic()))
        if count >= steps:
            break
        count = next_count(applied, time.monotonic() + 60)
    (first, before, t0), (last, after, t1) = snapshots[0], snapshots[-1]
    if last <= first:
        raise ConfigError("pstrain plan: the measured run was too short for a window; give more --measure-steps")
    n = last - first
    cpu = {role: (after[role] - before[role]) / n for role in ("chief", "ps", "worker") if role in after and role in before}
    return Observation(workers, ps, batch, (t1 - t0) / n, cpu, startup_s=startup_s)


def stop(launcher: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM the launcher (it stops and reaps its tasks), then reap it; SIGKILL after `grace_s`."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
    try:
        launcher.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()
