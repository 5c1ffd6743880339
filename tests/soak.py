"""A chaos soak: a realistic job trained on a local cluster while tasks are killed, frozen and restarted.

    python -m tests.soak --steps 2000 --seed 1

Trains tests/jobs/wide_deep.py (a user table sharded over 2 ps, BatchNorm, Dropout, Adagrad) with
`pstrain launch` on 2 ps and 2 workers while a seeded schedule injects faults into random ps and
workers, one at a time, each once the run has moved on since the last:

- kill: SIGKILL; pstrain restarts the task (a lost ps also restarts the chief, which resumes from
  the last checkpoint and recomputes the steps since);
- freeze: SIGSTOP, left stopped: past `heartbeat_timeout` pstrain must kill and restart it (SIGCONT
  follows only if it is still there at twice the timeout, and the report says so);
- pause: SIGSTOP, then SIGCONT before the heartbeat timeout: the run only stalls.

Then it checks that the run ended with exit 0 and every step logged once, that its final checkpoint
equals the fault-free (standalone) run's bit for bit, and that no process it or pstrain started is
left (psutil, by pid). It prints a short report and exits 1 when a check failed.
`tests/system/test_faults.py::test_soak_…` runs the same code with a few faults on a short run.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from cluster.rundir import RunDir
from tests.helpers import alive, metrics, run_pstrain, step_lines, task_pid

JOB = "tests.jobs.wide_deep"
HEARTBEAT_TIMEOUT_S = 4.0
PAUSE_S = 1.5  # shorter than the heartbeat timeout
SAVE_COUNTER = "save_counter/.ATTRIBUTES/VARIABLE_VALUE"
KINDS = (("worker", "kill"), ("worker", "freeze"), ("worker", "pause"), ("ps", "kill"), ("ps", "freeze"))


@dataclass(frozen=True)
class Fault:
    at_step: int  # injected once this many steps are logged (and the run moved on since the last fault)
    task: str  # "worker" or "ps"
    index: int
    kind: str  # "kill", "freeze" or "pause"

    @property
    def name(self) -> str:
        return f"{self.task}-{self.index}"


def schedule(seed: int, steps: int, count: int) -> list[Fault]:
    """`count` faults at seeded steps spread over 5..85 % of the run, of seeded kinds and tasks."""
    rng = random.Random(seed)
    span = range(steps // 20, steps * 85 // 100)
    at = sorted(rng.sample(span, count))
    return [Fault(step, *_kind(rng)) for step in at]


def _kind(rng: random.Random) -> tuple[str, int, str]:
    task, kind = rng.choice(KINDS)
    return task, rng.randrange(2), kind


@dataclass
class Injected:
    fault: Fault
    pid: int
    step: int  # steps logged when it was injected
    at_s: float  # seconds since the launch started
    note: str = ""  # e.g. "SIGCONT after 1.5s", "killed by pstrain"


@dataclass
class Injector:
    """A `run_pstrain` callback (polled every 0.1 s) that injects `faults` in order; True once all are
    injected and no SIGCONT is pending. A fault waits until `gap` more steps are logged since the last
    one and its task runs again (a frozen task's replacement, a killed one's restart)."""

    run_dir: Path
    faults: list[Fault]
    gap: int
    start: float = field(default_factory=time.monotonic)
    done: list[Injected] = field(default_factory=list)
    pending: list[tuple[float, Injected]] = field(default_factory=list)  # (when to SIGCONT, what)
    last_lines: int = 0
    signalled: set[int] = field(default_factory=set)  # every pid signalled (checked to be gone at the end)
    spent: set[int] = field(default_factory=set)  # pids killed or frozen: never a target again (a paused one is)

    def __call__(self) -> bool:
        from tests import helpers

        now, lines = time.monotonic(), step_lines(self.run_dir)
        for due, injected in list(self.pending):
            if now >= due:
                self.pending.remove((due, injected))
                injected.note = self._resume(injected, now)
        if len(self.done) < len(self.faults) and not self.pending:
            fault = self.faults[len(self.done)]
            pid = task_pid(helpers.current_launcher, fault.task, fault.index)
            ready = lines >= fault.at_step and lines >= self.last_lines + self.gap
            if ready and pid and pid not in self.spent and _running(pid):
                self._inject(fault, pid, lines, now)
        return len(self.done) == len(self.faults) and not self.pending

    def _inject(self, fault: Fault, pid: int, lines: int, now: float) -> None:
        injected = Injected(fault, pid, lines, now - self.start)
        psutil.Process(pid).send_signal(signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
        self.signalled.add(pid)
        if fault.kind != "pause":
            self.spent.add(pid)
        self.done.append(injected)
        self.last_lines = lines
        if fault.kind != "kill":
            wait = PAUSE_S if fault.kind == "pause" else 2 * HEARTBEAT_TIMEOUT_S
            self.pending.append((now + wait, injected))

    def _resume(self, injected: Injected, now: float) -> str:
        """SIGCONT a paused task; for a frozen one, whether pstrain killed it (else SIGCONT it)."""
        held = now - self.start - injected.at_s
        if not alive({injected.pid}):
            return f"killed by pstrain within {held:.0f}s"
        psutil.Process(injected.pid).send_signal(signal.SIGCONT)
        if injected.fault.kind == "pause":
            return f"SIGCONT after {held:.1f}s"
        return f"NOT killed by pstrain within {held:.0f}s; SIGCONT"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def flags(run_dir: Path, steps: int) -> list[str]:
    return ["--job", JOB, "--run-dir", str(run_dir), "--steps", str(steps), "--global-batch-size", "16"]


def config_file(directory: Path, faults: int) -> Path:
    path = directory / "soak.toml"
    path.write_text(
        f"[cluster]\nheartbeat_interval = 0.5\nheartbeat_timeout = {HEARTBEAT_TIMEOUT_S:g}\nmax_restarts = {faults + 1}\n"
    )
    return path


@dataclass
class Outcome:
    returncode: int
    output: str
    injected: list[Injected]
    steps_logged: list[int]
    max_difference: float | None  # the largest |cluster - standalone| over the final checkpoint (None: no checkpoint)
    different: list[str]  # checkpoint values that differ from the fault-free run's
    left_running: list[str]
    seconds: float
    steps: int
    planned: int  # faults scheduled (a run that ends first leaves some out)

    @property
    def every_step_once(self) -> bool:
        return self.steps_logged == list(range(self.steps))

    @property
    def ok(self) -> bool:
        same = self.max_difference == 0.0 and not self.different
        complete = len(self.injected) == self.planned
        return complete and self.returncode == 0 and self.every_step_once and same and not self.left_running


def run_soak(directory: Path, steps: int, faults: list[Fault], gap: int = 20, checkpoint_every: int = 100) -> Outcome:
    """The fault-free reference (standalone), then the cluster run with `faults` injected; nothing is
    asserted here (see `Outcome.ok`)."""
    reference = directory / "reference"
    standalone = run_pstrain(["train", "--standalone", *flags(reference, steps)], timeout=60 + steps * 0.1)
    if standalone.returncode != 0:
        raise RuntimeError(f"the fault-free reference run failed:\n{standalone.output[-3000:]}")
    run_dir = directory / "run"
    injector = Injector(run_dir, faults, gap)
    args = ["launch", *flags(run_dir, steps), "--ps", "2", "--workers", "2", "--checkpoint-every", str(checkpoint_every)]
    args += ["--config", str(config_file(directory, len(faults)))]
    started = time.monotonic()
    result = run_pstrain(args, timeout=120 + steps * 0.3 + 90 * len(faults), signal_when=injector, send=None)
    seconds = time.monotonic() - started
    for _, injected in injector.pending:  # the run ended first: nothing stays stopped
        injected.note = injector._resume(injected, time.monotonic())
    deadline = time.monotonic() + 10
    pids = result.seen_pids | injector.signalled
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [f"{p.pid} {' '.join(p.cmdline())}" for p in alive(pids)]
    records = metrics(run_dir)[0] if RunDir(run_dir).metrics.exists() else []
    difference, different = compare_checkpoints(run_dir, reference)
    return Outcome(
        result.returncode,
        result.output,
        injector.done,
        [r["step"] for r in records],
        difference,
        different,
        left,
        seconds,
        steps,
        len(faults),
    )


def compare_checkpoints(run_dir: Path, reference: Path) -> tuple[float | None, list[str]]:
    """(the largest absolute difference, the names of values that differ) between the two runs' latest checkpoints."""
    import tensorflow as tf

    found = tf.train.latest_checkpoint(str(run_dir / "checkpoints"))
    if found is None:
        return None, ["no checkpoint"]
    ours, theirs = (
        tf.train.load_checkpoint(found),
        tf.train.load_checkpoint(tf.train.latest_checkpoint(str(reference / "checkpoints"))),
    )
    names, wanted = set(ours.get_variable_to_shape_map()), set(theirs.get_variable_to_shape_map())
    different, largest = sorted(names ^ wanted), 0.0
    for name in sorted(names & wanted - {SAVE_COUNTER}):  # a restarted run saves more often: not the model
        got, want = np.asarray(ours.get_tensor(name)), np.asarray(theirs.get_tensor(name))
        if got.dtype.kind in "fiu" and not np.array_equal(got, want):
            different.append(name)
            largest = max(largest, float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))))
    return largest, different


def restarts(output: str, name: str) -> list[str]:
    """pstrain's console lines that restart the task `name`, in order (one per kill or freeze of it)."""
    prefix = f"pstrain: warning: {name} "
    return [line[len("pstrain: ") :] for line in output.splitlines() if line.startswith(prefix) and "restarting" in line]


def report(outcome: Outcome) -> str:
    lines = [
        f"soak: {len(outcome.injected)} of {outcome.planned} faults in {outcome.seconds:.0f}s of {outcome.steps} steps; "
        f"exit code {outcome.returncode}"
    ]
    said = {name: restarts(outcome.output, name) for name in {i.fault.name for i in outcome.injected}}
    for injected in outcome.injected:
        fault = injected.fault
        reaction = (
            "(a stall only)" if fault.kind == "pause" else said[fault.name].pop(0) if said[fault.name] else "(nothing said)"
        )
        what = f"{fault.kind:6} {fault.name} (pid {injected.pid}) at step {injected.step}, {injected.at_s:.0f}s"
        note = f"; {injected.note}" if injected.note else ""
        lines.append(f"  {what}{note}; pstrain: {reaction}")
    chief = [line for line in outcome.output.splitlines() if "restarting the chief" in line]
    lines.append(f"  chief restarts (a lost ps): {len(chief)}" + "".join(f"\n    {line}" for line in chief))
    lines.append(f"  every step logged once: {'yes' if outcome.every_step_once else 'NO'}")
    if outcome.max_difference is None:
        lines.append("  final model: no checkpoint to compare")
    else:
        same = (
            "bit for bit"
            if not outcome.different
            else f"{len(outcome.different)} values differ, by up to {outcome.max_difference:g}"
        )
        lines.append(f"  final checkpoint vs the fault-free run: {same}")
    lines.append(f"  processes left running: {len(outcome.left_running)}" + "".join(f"\n    {p}" for p in outcome.left_running))
    lines.append("soak: " + ("OK" if outcome.ok else "FAILED"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", type=int, default=8, help="how many faults to inject (default 8)")
    parser.add_argument("--dir", type=Path, help="where the runs go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    if not 1 <= args.faults <= args.steps // 100:
        parser.error(f"--faults must be between 1 and steps/100 ({args.steps // 100})")
    directory = args.dir or Path(tempfile.mkdtemp(prefix="pstrain-soak-"))
    directory.mkdir(parents=True, exist_ok=True)
    faults = schedule(args.seed, args.steps, args.faults)
    print(f"soak: seed {args.seed}, {args.steps} steps, runs in {directory}; schedule:", flush=True)
    for fault in faults:
        print(f"  step {fault.at_step}: {fault.kind} {fault.name}", flush=True)
    outcome = run_soak(directory, args.steps, faults)
    print(report(outcome))
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
