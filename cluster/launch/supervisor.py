"""Child processes of the launcher: started with their setup's env, logged per task, always reaped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from cluster.errors import WriteError, write_error
from cluster.launch.console import ConsoleFilter
from cluster.launch.netns import PrivateNetwork
from cluster.task import TaskId
from cluster.task_setup import TaskSetup
from cluster.taskenv import TaskEnv

ROOT = str(Path(__file__).resolve().parents[2])  # pstrain's checkout: cluster/, chief/, worker/


@dataclass
class Child:
    setup: TaskSetup
    process: subprocess.Popen
    log_path: Path
    argv: list[str]
    extra_env: dict[str, str]
    echo: BinaryIO | None = None
    pump: threading.Thread | None = None
    restarts: int = 0
    restart_times: tuple[float, ...] = ()  # when it was restarted (seconds since the epoch): the restart budget
    log_error: WriteError | None = None  # why its log could not be written (no space, no permission; set by the pump)

    @property
    def task(self) -> TaskId:
        return self.setup.task


class Supervisor:
    def __init__(self, log_dir: Path, network: PrivateNetwork | None = None):
        """`network`: the private network namespace every task starts in (None: this machine's own)."""
        self.log_dir = log_dir
        self.network = network
        self.children: list[Child] = []

    def start(self, setup: TaskSetup, argv: list[str], echo: BinaryIO | None = None, extra_env: dict | None = None) -> Child:
        """Start a task; its output goes to logs/<type>-<index>.log (and to `echo` if given)."""
        log_path = self.log_dir / f"{setup.task.log_name}.log"
        log_file = open(log_path, "ab")
        # The task arms "die with parent" itself (cluster/taskenv.py), so no task outlives us.
        env = {**os.environ, **setup.env, **(extra_env or {}), **TaskEnv(parent_pid=os.getpid()).to_env()}
        env["PYTHONPATH"] = packages_first(env.get("PYTHONPATH", ""))
        process = subprocess.Popen(
            self.network.wrap(argv) if self.network else argv,  # the same pid either way
            pass_fds=self.network.fds if self.network else (),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if echo else log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops children in order
        )
        child = Child(setup, process, log_path, argv, dict(extra_env or {}), echo)
        if echo:
            child.pump = threading.Thread(target=_pump, args=(process.stdout, log_file, echo, child), daemon=True)
            child.pump.start()
        else:
            log_file.close()
        self.children.append(child)
        return child

    def restart(self, child: Child) -> Child:
        """Start the same task again (same setup, command and environment); the log continues."""
        self.reap(child)
        self.children.remove(child)
        new = self.start(child.setup, child.argv, child.echo, child.extra_env)
        new.restarts = child.restarts + 1
        new.restart_times = (*child.restart_times, time.time())
        return new

    @staticmethod
    def reap(child: Child) -> None:
        """Wait for an exited (or killed) task and the copy of its last output."""
        child.process.wait()
        if child.pump:
            child.pump.join(timeout=5)

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every task, SIGKILL what is left after `grace_s`; all reaped."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                try:
                    child.process.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
            self.reap(child)


def _pump(source: BinaryIO, log_file: BinaryIO, echo: BinaryIO, child: Child) -> None:
    """Copy a child's output to its log byte for byte, and pstrain's lines of it (progress bars keep
    their \\r) to the console; TensorFlow's own output stays in the log (cluster/launch/console.py).
    A log that cannot be written is given up (`child.log_error` set when the operator can fix it); the console
    still gets every line."""
    console = ConsoleFilter()
    log: BinaryIO | None = log_file
    while chunk := os.read(source.fileno(), 65536):
        if log is not None:
            try:
                log.write(chunk)
                log.flush()
            except OSError as e:
                child.log_error, log = write_error(e, child.log_path), None
        echo_console(console, echo, chunk)
    with contextlib.suppress(OSError):  # closing flushes what a full disk refused
        log_file.close()


def packages_first(python_path: str) -> str:
    """`python_path` with pstrain's own root in front. A task runs `python -m chief` (or worker) in the
    user's working directory, which comes first on sys.path; a directory there named like one of
    pstrain's packages (a run dir `--run-dir cluster`) would be imported in its place as a namespace
    package, as an editable install's finder is asked only after sys.path. A regular package on
    sys.path wins over such a directory, wherever it comes."""
    return os.pathsep.join(dict.fromkeys([ROOT, *filter(None, python_path.split(os.pathsep))]))


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def echo_console(console, echo, chunk: bytes) -> None:
    """Write to `echo` what `console` lets through of `chunk` (pstrain's own lines); a console that is
    gone (closed, a broken pipe) is not an error of the run."""
    shown = console.feed(chunk)
    try:
        if shown:
            echo.write(shown)
            echo.flush()
    except (OSError, ValueError):
        pass
