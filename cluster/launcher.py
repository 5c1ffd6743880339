"""`pstrain launch`: start ps and worker servers, wait for them, run the chief, reap everything."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from cluster import rundir
from cluster.config import Config
from cluster.plan import plan_servers, plan_task
from cluster.ports import assign_ports, wait_listening
from cluster.supervisor import Child, Supervisor, exit_code, python_module

CHIEF_STOP_GRACE_S = 8.0  # time for the chief to checkpoint after SIGTERM before it is killed


def describe_not_ready(child: Child) -> str:
    code = child.process.poll()
    state = "not listening" if code is None else f"exited with code {exit_code(code)}"
    return f"{child.name} at {child.plan.address} ({state}; see {child.log_path})"


def launch(config: Config) -> int:
    """Run a whole cluster on this machine; returns the chief's exit code."""
    train = config.train
    cluster = assign_ports(config.cluster)
    run_dir = Path(train.run_dir)
    rundir.prepare(run_dir, rundir.describe("cluster", train, cluster), train)
    supervisor = Supervisor(run_dir / "logs")
    stop_signal: list[int] = []

    def on_signal(signum, _frame):
        stop_signal.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    say = print
    try:
        servers = [supervisor.start(plan, python_module("worker")) for plan in plan_servers(cluster)]
        say(f"pstrain: {len(cluster.ps)} ps + {len(cluster.workers)} workers starting; logs in {run_dir / 'logs'}", flush=True)

        def dead_server() -> str | None:
            if stop_signal:
                return "stop requested"
            child = supervisor.first_dead()
            return child.name if child else None

        missing = wait_listening({c.name: c.plan.address for c in servers}, train.startup_timeout, dead_server)
        if stop_signal:
            return 128 + stop_signal[0]
        if missing:
            details = ", ".join(describe_not_ready(c) for c in servers if c.name in missing)
            print(f"pstrain: error: tasks not ready after {train.startup_timeout:g}s: {details}", file=sys.stderr)
            return 1
        chief_env = {"PSTRAIN_TTY": "1" if sys.stdout.isatty() else "0"}
        chief = supervisor.start(
            plan_task(cluster, "chief", 0),
            python_module("chief", "--run-dir", str(run_dir)),
            echo=sys.stdout.buffer,
            extra_env=chief_env,
        )
        reported: set[str] = set()
        forwarded = False
        while chief.process.poll() is None:
            if stop_signal and not forwarded:
                chief.process.send_signal(stop_signal[0])  # checkpoint at the next step, then exit
                forwarded, deadline = True, time.monotonic() + CHIEF_STOP_GRACE_S
            if forwarded and time.monotonic() > deadline:
                chief.process.kill()
            dead = supervisor.first_dead(exclude=chief)
            if dead and dead.name not in reported:
                reported.add(dead.name)
                print(
                    f"pstrain: {dead.name} exited with code {exit_code(dead.process.returncode)} (see {dead.log_path})",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.1)
        supervisor.stop(chief, grace_s=0)
        code = exit_code(chief.process.returncode)
        return 128 + stop_signal[0] if stop_signal and code else code
    finally:
        supervisor.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
