"""Running pstrain as a user would (a real subprocess), and checking nothing is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pytest

from cluster.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
PSTRAIN = [sys.executable, "-m", "cluster.cli"]
current_launcher = 0  # pid of the pstrain process run_pstrain is running, for signal_when callbacks
STEPS_PER_EXECUTION: int | None = None  # pytest --steps-per-execution K (conftest): every run_pstrain launch/train at K
DENSE: str | None = None  # pytest --dense MODE (conftest): every run_pstrain launch/train with train.dense = MODE
HYBRID_REFUSAL = 'pstrain: error: train.dense = "allreduce"'  # how the launch refuses a run the hybrid cannot keep exact


def with_session_flags(args: list[str]) -> list[str]:
    """`args` with the session's `--steps-per-execution K` and `--dense MODE` added to a `launch` or
    `train` that does not set its own (`pytest --steps-per-execution 1`: the chief on every step's path;
    `pytest --dense allreduce`: every run takes the hybrid step). Without the options, `args` unchanged."""
    if not args or args[0] not in ("launch", "train"):
        return args
    added = []
    if STEPS_PER_EXECUTION is not None and "--steps-per-execution" not in args:
        added += ["--steps-per-execution", str(STEPS_PER_EXECUTION)]
    if _session_sets_dense(args):
        added += ["--dense", DENSE]
    return [args[0], *added, *args[1:]]


def _session_sets_dense(args: list[str]) -> bool:
    """Whether `pytest --dense MODE` sets this run's mode: a `launch` or `train` without its own `--dense`."""
    return DENSE is not None and bool(args) and args[0] in ("launch", "train") and "--dense" not in args


def skip_if_the_session_hybrid_refused(args: list[str], result: Result) -> None:
    """Under `pytest --dense allreduce`, a run the session switched to the hybrid and the launch refused in
    its one line (settings the hybrid cannot keep exact: chief/step/hybrid.py `refusal`) skips the test,
    naming the refusal: the test's own mode never ran, so it neither passed nor failed."""
    if DENSE != "allreduce" or not _session_sets_dense(args) or result.returncode != 2:
        return
    refusals = [line for line in result.output.splitlines() if line.startswith(HYBRID_REFUSAL)]
    if refusals:
        assert_no_orphans(result)
        pytest.skip(f"the hybrid refuses this run: {refusals[0].removeprefix('pstrain: error: ')}")


def lost_worker_warning(what: str, count: str = "1 of 3") -> str:
    """The launcher's warning for a lost worker (`what`, e.g. "worker-1 exited (137)") as the session's dense
    mode words it (cluster/launch/watch.py): under the hybrid every worker restarts with the chief, so the
    line says why in place of the worker's own restart count."""
    if DENSE == "allreduce":
        return f'{what}; train.dense = "allreduce": the other workers\' collectives ended with it'
    return f"{what}; restarting ({count})"


def chief_restart_warning(lost: str) -> str:
    """The launcher's warning when the chief restarts after `lost` (e.g. "ps-0"), as the session's dense
    mode words it: under the hybrid every worker restarts too."""
    which = "every worker and the chief" if DENSE == "allreduce" else "the chief"
    return f"pstrain: warning: lost {lost}; restarting {which} to resume from checkpoint step "


@dataclass
class Result:
    returncode: int
    output: str
    seen_pids: set[int] = field(default_factory=set)


def _descendants(process: psutil.Process) -> set[int]:
    try:
        return {p.pid for p in process.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def descendant_pids(pids) -> set[int]:
    """Every running descendant of the processes `pids` (gone ones contribute nothing)."""
    out: set[int] = set()
    for pid in pids:
        try:
            out |= _descendants(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def alive(pids: set[int]) -> list[psutil.Process]:
    """Processes among `pids` that still run (zombies count as gone: they hold no resources)."""
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def run_pstrain(
    args: list[str],
    timeout: float = 300,
    signal_when=None,
    send: int | None = signal.SIGINT,  # None: signal_when acts by itself
    env: dict | None = None,
    poll_s: float = 0.1,
    cwd: Path | None = None,
) -> Result:
    """Run `pstrain ARGS` (in `cwd`, default the checkout), recording every descendant pid; optionally send
    a signal when `signal_when()` turns true (asked every `poll_s`). Kills what remains on timeout (and fails)."""
    global current_launcher
    process = subprocess.Popen(
        PSTRAIN + with_session_flags(args),
        cwd=cwd or ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        text=True,
    )
    current_launcher = process.pid
    ps = psutil.Process(process.pid)
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    signalled = False
    while process.poll() is None and time.monotonic() < deadline:
        seen |= _descendants(ps)
        if signal_when and not signalled and signal_when():
            if send:
                process.send_signal(send)
            signalled = True
        time.sleep(poll_s)
    if process.poll() is None:
        for p in alive(seen | {process.pid}):
            p.kill()
        process.wait()
        raise AssertionError(f"pstrain {' '.join(args)} did not finish within {timeout}s:\n{process.stdout.read()}")
    result = Result(process.returncode, process.stdout.read(), seen)
    skip_if_the_session_hybrid_refused(args, result)
    return result


def handles_sigterm(pid: int) -> bool:
    """Whether process `pid` catches or ignores SIGTERM now (its SigCgt/SigIgn masks in /proc; Linux)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = dict(line.split(":\t", 1) for line in status.splitlines() if line.startswith(("SigCgt", "SigIgn")))
    return any(int(mask, 16) >> (signal.SIGTERM - 1) & 1 for mask in masks.values())


def wait_for_sigterm_handler(pid: int, timeout_s: float = 60.0) -> None:
    """Return once process `pid` has set its SIGTERM handler (the event a test sends SIGTERM after)."""
    deadline = time.monotonic() + timeout_s
    while not handles_sigterm(pid):
        assert time.monotonic() < deadline, f"process {pid} set no SIGTERM handler within {timeout_s:g}s"
        time.sleep(0.02)


def assert_no_orphans(result: Result, within_s: float = 30.0) -> None:
    """No process the run started outlives it: waits for each one's exit (the event it asserts on) and
    fails naming those left; `within_s` only bounds the wait, generous for 2 busy cores."""
    deadline = time.monotonic() + within_s
    while (running := alive(result.seen_pids)) and time.monotonic() < deadline:
        psutil.wait_procs(running, timeout=0.2)
    left = alive(result.seen_pids)
    assert not left, f"processes left running: {[(p.pid, p.cmdline()) for p in left]}"


def metrics(run_dir: Path) -> tuple[list[dict], dict | None]:
    """(the step lines, the done line or None) of a run's metrics.jsonl, read as RunDir reads it back: the one
    helper the tests read metrics through."""
    steps, done = [], None
    for record in RunDir(run_dir).read_metrics():
        if record.get("event") == "done":
            done = record
        elif "event" not in record:  # step lines; eval lines have their own event
            steps.append(record)
    return steps, done


def assert_both_workers_each_step(records: list[dict], starts: int = 1, first_steps: tuple[int, ...] | None = None) -> None:
    """Every step applied 2 gradients, and had both workers' in all but at most `starts` steps (how many
    times the chief started), each of those a start's first step (in `first_steps` when given) and on one
    worker. A step dispatched alone (a started chief's first, while its functions and data are made)
    lets a free worker take both slots' closures; a block's closures run at once, one per worker, as each
    waits at the gate for the others."""
    assert all(r["aggregated"] == 2 for r in records), [r["aggregated"] for r in records]
    alone = [(r["step"], r["workers"]) for r in records if r["workers"] != [0, 1]]
    assert len(alone) <= starts and all(len(w) == 1 for _, w in alone), alone
    if first_steps is not None:
        assert {step for step, _ in alone} <= set(first_steps), alone


def predictions(run_dir: Path, features) -> np.ndarray:
    """The exported model's serving_default on `features` (an array, or a dict of named inputs)."""
    import tensorflow as tf

    serve = tf.saved_model.load(str(RunDir(run_dir).saved_model)).signatures["serving_default"]
    if isinstance(features, dict):
        return serve(**{k: tf.constant(v) for k, v in features.items()})["predictions"].numpy()
    return serve(tf.constant(features))["predictions"].numpy()


def task_pid(root_pid: int, task_type: str, index: int) -> int | None:
    """The pid of a running task (by its TF_CONFIG) among the descendants of `root_pid`."""
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            config = json.loads(child.environ().get("TF_CONFIG", "{}"))
        except (psutil.Error, ValueError):
            continue
        if config.get("task") == {"type": task_type, "index": index}:
            return child.pid
    return None


def step_lines(run_dir: Path) -> int:
    """How many lines the run's metrics.jsonl has (0: none yet), a cut-short last one included."""
    path = RunDir(run_dir).metrics
    return len(path.read_text().splitlines()) if path.exists() else 0


def kill_task_when(run_dir: Path, task_type: str, index: int, after_steps: int, killed: list, sig: int = signal.SIGKILL):
    """A `run_pstrain` signal_when callback: send `sig` (SIGKILL; SIGSTOP hangs it) to one task once
    `after_steps` steps are logged; `killed` gets its pid."""

    def act() -> bool:
        if killed or step_lines(run_dir) < after_steps:
            return False
        pid = task_pid(current_launcher, task_type, index)
        if pid:
            psutil.Process(pid).send_signal(sig)
            killed.append(pid)
        return bool(killed)

    return act
