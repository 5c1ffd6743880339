"""A run directory belongs to one run: RUN_DIR/pstrain.lock, held with flock(2) while the run lives.

The kernel drops the flock when its holder exits, however it dies, so a lock whose holder is gone
is taken over. The file records the holder (host, pid, process start time, command, control plane)
for the refusal message; the start time (psutil's create_time) tells a live holder from another
process that got its pid later. What counts as stale is `is_stale`, a pure function.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import psutil

from cluster.errors import ConfigError, writing
from cluster.rundir import LOCK_NAME, RunDir  # noqa: F401  (LOCK_NAME: the name, for tests)

SAME_PROCESS_S = 0.05  # create_time is a float rounded by the kernel's clock ticks; closer is the same process


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    create_time: float  # the holder's process start (psutil), seconds since the epoch
    command: str  # "pstrain launch", "pstrain train --standalone"
    control: str = ""  # the run dir whose control.json names the holder's control plane, where it serves one

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder a lock file names; None for an empty or unreadable one (a holder cut short)."""
        try:
            data = json.loads(text)
            return cls(
                str(data["host"]), int(data["pid"]), float(data["create_time"]), str(data["command"]), data.get("control", "")
            )
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.create_time))
        return f"{self.command} pid {self.pid} on host {self.host} since {since}"


def is_stale(holder: Holder, host: str, running_since: float | None) -> bool:
    """Is `holder` gone? `host`: this machine's name; `running_since`: the create_time of the process
    that has `holder.pid` here now (None: no such process). A holder on another host is never judged
    stale from here (its process cannot be seen); one here is stale when its pid is free or reused."""
    if holder.host != host:
        return False
    return running_since is None or abs(running_since - holder.create_time) > SAME_PROCESS_S


def refusal(run_dir: Path, holder: Holder) -> str:
    """The one line for a run dir another run holds."""
    how = f"pstrain stop --run-dir {holder.control}" if holder.control else f"kill -INT {holder.pid}"
    return f"{run_dir} is in use by {holder.describe()}; stop it ({how}) or use another --run-dir"


def read_holder(run_dir: RunDir) -> Holder | None:
    """The live run holding `run_dir` from this machine, or None (no holder, or one that is gone)."""
    try:
        holder = Holder.parse(run_dir.lock.read_text())
    except OSError:
        return None
    here = socket.gethostname()
    if holder is None or holder.host != here or is_stale(holder, here, process_start(holder.pid)):
        return None
    return holder


def process_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


class RunDirLock:
    """`with RunDirLock(run_dir, "pstrain launch") as lock:` ... the run ... ; raises ConfigError
    (exit 2) naming the holder when another live run holds `run_dir`, having written nothing there."""

    def __init__(self, run_dir: RunDir, command: str, say=print):
        """`run_dir`: the run's layout; `lock.run_dir` is its path, `lock.layout` the layout itself."""
        self.layout, self.run_dir, self.path, self.say = run_dir, run_dir.path, run_dir.lock, say
        me = psutil.Process()
        self.holder = Holder(socket.gethostname(), me.pid, me.create_time(), command)
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = Holder.parse(_read(fd))
                os.close(fd)
                raise ConfigError(
                    refusal(self.run_dir, holder)
                    if holder
                    else f"{self.run_dir} is in use by another pstrain run; use another --run-dir"
                ) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder removed the file between our open and flock: lock the new one
        previous = Holder.parse(_read(fd))
        here = self.holder.host
        if previous and not is_stale(previous, here, process_start(previous.pid) if previous.host == here else None):
            os.close(fd)  # a flock may not reach across machines on a network file system: believe the file
            raise ConfigError(refusal(self.run_dir, previous) + f" (if that run is gone, delete {self.path})")
        if previous:
            self.say(f"pstrain: warning: taking over {self.run_dir} from {previous.describe()}, which is no longer running")
        self._fd = fd
        self._write(self.holder)
        return self

    def set_control(self, control: str) -> None:
        """Record the run dir that names the control plane, so a refused second run can say how to stop this one."""
        self.holder = replace(self.holder, control=control)
        self._write(self.holder)

    def _write(self, holder: Holder) -> None:
        assert self._fd is not None
        with writing(self.path):
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, (json.dumps(asdict(holder)) + "\n").encode(), 0)

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: a waiter then locks a new file
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        return ""


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
