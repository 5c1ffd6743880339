"""The launcher's Supervisor over Ray actors: each task's process runs in its TaskHost actor on the
node Ray placed it on, and the launcher's ClusterWatch (watch.py) watches, signals and restarts it
through a Popen-like handle. A task whose actor is gone (its node lost) cannot be restarted in place:
the first poll that finds it so raises NodeLost, out of the watch, to the engine that places the
cluster again (cluster/launch/ray_engine.py)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from cluster.errors import PstrainError
from cluster.launch.console import ConsoleFilter
from cluster.launch.supervisor import Child, Supervisor, echo_console
from cluster.task import TaskId
from cluster.task_setup import TaskSetup

RPC_TIMEOUT_S = 10.0  # a start or signal call to a task's actor
POLL_EVERY_S = 0.2  # a running task's state is asked at most this often


class NodeLost(PstrainError):
    """A task's actor is gone: Ray lost its node (or the actor); the cluster must be placed again."""

    def __init__(self, task: TaskId, address: str):
        super().__init__(f"{task} at {address}: its Ray actor is gone (node lost)")
        self.task, self.address = task, address


class RemoteProcess:
    """The parts of subprocess.Popen the launcher uses, for a process that a TaskHost actor runs."""

    def __init__(self, ray: Any, host: Any, pid: int, args: list[str], on_lost: Callable[[], None] = lambda: None):
        self.ray, self.host, self.pid, self.args, self.on_lost = ray, host, pid, args, on_lost
        self.returncode: int | None = None
        self.lost = False  # the actor died: the process died with it (SIGKILL reported)
        self._next_poll = 0.0

    def poll(self) -> int | None:
        if self.returncode is None and time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + POLL_EVERY_S
            try:
                self.returncode = self.ray.get(self.host.poll.remote(), timeout=RPC_TIMEOUT_S)
            except self.ray.exceptions.ActorUnavailableError:
                pass  # unreachable for now; Ray says when it is gone for good
            except self.ray.exceptions.RayActorError:
                self.returncode, self.lost = -signal.SIGKILL, True
                self.on_lost()
            except self.ray.exceptions.GetTimeoutError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                self.ray.get(self.host.signal.remote(signum), timeout=RPC_TIMEOUT_S)
            except self.ray.exceptions.RayError:
                pass  # the next poll says whether the actor is gone

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class RaySupervisor(Supervisor):
    """Starts each task in its own actor (`hosts`); logs are written by the task on its node into the
    shared run dir, and the chief's (`echo`) is followed from there to the console. The first task
    found lost raises NodeLost (once: the stop that follows sees the others as killed)."""

    def __init__(self, ray: Any, log_dir: Path, hosts: dict[TaskId, Any]):
        super().__init__(log_dir)
        self.ray, self.hosts = ray, hosts
        self.armed = True  # NodeLost not raised yet, and no stop under way

    def _lost(self, setup: TaskSetup) -> None:
        if self.armed:
            self.armed = False
            raise NodeLost(setup.task, setup.address)

    def stop_all(self, grace_s: float = 5.0) -> None:
        self.armed = False
        super().stop_all(grace_s)

    def start(self, setup: TaskSetup, argv: list[str], echo: BinaryIO | None = None, extra_env: dict | None = None) -> Child:
        log_path = self.log_dir / f"{setup.task.log_name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        host = self.hosts[setup.task]
        try:
            pid = self.ray.get(host.start.remote(setup, argv, dict(extra_env or {})), timeout=RPC_TIMEOUT_S)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
            self.armed = False
            raise NodeLost(setup.task, setup.address) from None
        process = RemoteProcess(self.ray, host, pid, argv, on_lost=lambda: self._lost(setup))
        child = Child(setup, process, log_path, argv, dict(extra_env or {}), echo)  # type: ignore[arg-type]
        if echo:
            child.pump = threading.Thread(target=follow, args=(log_path, offset, echo, process), daemon=True)
            child.pump.start()
        self.children.append(child)
        return child


def follow(log_path: Path, offset: int, echo: BinaryIO, process: RemoteProcess) -> None:
    """Copy pstrain's lines of a task's log (from `offset`) to the console until the task has ended."""
    console = ConsoleFilter()
    while not log_path.exists() and process.returncode is None:
        time.sleep(0.1)
    try:
        source = open(log_path, "rb")
    except OSError:
        return
    with source:
        source.seek(offset)
        while True:
            ended = process.returncode is not None
            chunk = source.read(65536)
            if chunk:
                echo_console(console, echo, chunk)
            elif ended:
                return
            else:
                time.sleep(0.1)
