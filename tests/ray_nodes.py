"""Real Ray nodes for the tests: `ray start --block` (Ray's own CLI, from the Python that runs the
tests), started and stopped by pid, with everything each started reaped at the end.

A node started with `--block` is one process whose children are Ray's (GCS, raylet, agents); SIGTERM
to it stops them. Draining is turned off (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0): a node stopped
after its head would otherwise wait 30 s for a GCS that is gone.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import alive

RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` command, whatever venv runs the tests
# A token of the tests' own for Ray's token authentication, no usage stats, no drain on SIGTERM.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(16),
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
}
SMALL = ["--num-gpus=0", "--object-store-memory=80000000", "--disable-usage-stats"]  # 80 MB: Ray's floor is 75


class RayNode:
    """One `ray start --block` process; `family` collects every pid it started, for the reaping."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None, prefix: list[str] | None = None):
        self.log = log
        command = (prefix or []) + RAY_CLI + ["start", "--block", *argv, *SMALL]
        self.process = subprocess.Popen(
            command, env={**os.environ, **RAY_ENV, **(env or {})}, stdout=open(log, "w"), stderr=subprocess.STDOUT
        )
        self.family: set[int] = set()
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"ray start failed:\n{log.read_text()}")
            time.sleep(0.2)
        self.note_family()

    def note_family(self) -> None:
        try:
            self.family |= {p.pid for p in psutil.Process(self.process.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def stop(self) -> None:
        """SIGTERM (Ray stops its processes), SIGKILL after 30 s; then any process it started that is
        still alive (an agent that ignored SIGTERM) is killed by pid."""
        self.note_family()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        deadline = time.monotonic() + 10
        while self.left() and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in self.left():
            p.kill()

    def left(self) -> list[psutil.Process]:
        """The processes this node started that are still running (zombies do not count)."""
        return alive(self.family)

    def pstrain_left(self) -> list[psutil.Process]:
        """What pstrain left on this node: a TaskHost actor or a task process (one with a TF_CONFIG)."""
        left = []
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in children:
            try:
                if p.status() != psutil.STATUS_ZOMBIE and ("TaskHost" in p.name() or "TF_CONFIG" in p.environ()):
                    left.append(p)
            except psutil.Error:
                pass
        return left


def assert_nothing_left(nodes: list[RayNode], within_s: float = 20.0) -> None:
    """No pstrain actor and no task process on any of `nodes` (within `within_s`: Ray reaps an actor
    a moment after the driver has gone)."""
    deadline = time.monotonic() + within_s
    while any(n.pstrain_left() for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(p.pid, p.name()) for n in nodes for p in n.pstrain_left()]
    assert not left, f"left on the Ray nodes: {left}"
