"""The servers beside the chief load TensorFlow in turns, so the chief keeps a core at start-up.

`pstrain launch` starts the ps and workers of its machine next to the chief, on the same cores. Each
server loads TensorFlow's runtime and starts its gRPC server, about 1 s of CPU (worker/tf_runtime.py).
At the same time the chief imports TensorFlow's Python API, about 3 s, and that import is most of the
start-up's critical path. On 2 cores, four processes loading at once left the chief about half a core
for its first 2 s (docs/benchmarks/2026-12-07-every-workload-on-loopback-and-1gbit.md).

So the servers the launcher starts (TaskEnv.start_turns) load at most `turn_count(cores)` at a time,
all cores but one, and the chief keeps a core; with cores to spare (a GPU box) nothing waits. Servers
on machines without the chief (`pstrain node`, Slurm, pods, Ray) do not take turns. On 2 cores the
servers then load one after another, and the chief may wait a few tenths of a second for the last.

A turn is an exclusive `flock` on one of `turn_count` files in a per-user directory of $TMPDIR (or
/tmp), which this user must own, held from before the load until the server serves. The kernel
releases it when the process ends, however it ends. A server waits at most `MAX_WAIT_S` for a turn,
then starts anyway; where the files cannot be made or locked it starts without one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

MAX_WAIT_S = 5.0  # the longest a server waits for its turn: a few servers' loads
POLL_S = 0.02


def turn_count(cores: int) -> int:
    """How many servers of a machine with `cores` usable cores may load TensorFlow at once: all cores
    but the chief's, and at least one."""
    return max(1, cores - 1)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as taskset or a cpuset sets it)."""
    return len(os.sched_getaffinity(0))


def turns_directory() -> Path:
    """Where this user's servers keep the turn files: one place per machine and user."""
    return Path(os.environ.get("TMPDIR") or "/tmp") / f"pstrain-{os.getuid()}-start-turns"


def open_turn_files(directory: Path, count: int) -> list[int]:
    """Descriptors of the `count` turn files in `directory`, made if missing. Raises OSError where the
    directory is not a folder of this user's (another user's, a link) or a file cannot be opened; none
    stays open then."""
    directory.mkdir(mode=0o700, exist_ok=True)
    found = os.lstat(directory)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
        raise PermissionError(f"{directory} is not a folder of this user's")
    files: list[int] = []
    try:
        for i in range(count):
            files.append(os.open(directory / f"turn-{i}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    except OSError:
        for fd in files:
            os.close(fd)
        raise
    return files


@contextlib.contextmanager
def start_turn(cores: int | None = None, directory: Path | None = None, max_wait_s: float = MAX_WAIT_S) -> Iterator[bool]:
    """Hold one of the machine's `turn_count(cores)` turns for the block. Yields whether a turn was
    held: False after `max_wait_s` without one, or where the turn files cannot be made or locked (the
    block then runs without one; a start is never refused for this)."""
    files: list[int] = []
    held = False
    try:
        count = turn_count(usable_cores() if cores is None else cores)
        files = open_turn_files(turns_directory() if directory is None else directory, count)
        held = _take_one(files, time.monotonic() + max_wait_s)
    except OSError:
        held = False
    try:
        yield held
    finally:
        for fd in files:
            os.close(fd)  # closing the descriptor releases its lock


def _take_one(files: list[int], deadline: float) -> bool:
    """Lock one of `files` (non-blocking tries, every POLL_S) before `deadline`; whether one was locked.
    A lock the file system does not support raises OSError."""
    while True:
        for fd in files:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                continue
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
