"""The servers of one machine load TensorFlow in turns, so the chief keeps a core at start-up.

A local cluster starts its ps and workers next to the chief, on the same cores. Each server loads
TensorFlow's runtime and starts its gRPC server, about 1 s of CPU (worker/tf_runtime.py). At the same
time the chief imports TensorFlow's Python API, about 3 s, and that import is the start-up's critical
path: the servers are up long before the chief needs them. On 2 cores, four processes loading at once
leave the chief half a core until the servers are done. Measured on this 2-core machine (a recommender
job, 1 ps and 2 workers), each server had spent 0.85 s of CPU after 2 s, and so had the chief.

So at most `cores - 1` servers of a machine load at once (`concurrent_starts`), and the chief keeps a
core. On a machine with cores to spare (a GPU box), nothing waits.

A turn is an exclusive `flock` on one of `concurrent_starts` files in a per-user directory of the
system's temporary directory, shared by every pstrain server on the machine. It is held from before
the load until the server serves. The kernel releases it when the process ends, however it ends. A
server waits at most `MAX_WAIT_S` for a turn and then starts anyway, so a stopped or stuck process
cannot hold back the machine's starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

MAX_WAIT_S = 5.0  # the longest a server waits for its turn: a few servers' loads
POLL_S = 0.02


def concurrent_starts(cores: int) -> int:
    """How many servers of a machine with `cores` usable cores may load TensorFlow at once: all cores
    but the chief's, and at least one."""
    return max(1, cores - 1)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as taskset or a cpuset sets it)."""
    return len(os.sched_getaffinity(0))


def turns_directory() -> Path:
    """Where this user's servers keep the turn files: one place per machine and user."""
    return Path(tempfile.gettempdir()) / f"pstrain-{os.getuid()}-start-turns"


@contextlib.contextmanager
def start_turn(cores: int | None = None, directory: Path | None = None, max_wait_s: float = MAX_WAIT_S) -> Iterator[bool]:
    """Hold one of the machine's `concurrent_starts(cores)` turns for the block. Yields whether a turn
    was held: False after `max_wait_s` without one, or where the turn files cannot be made (the block
    then runs without a turn; a start is never refused for this)."""
    n = concurrent_starts(usable_cores() if cores is None else cores)
    directory = turns_directory() if directory is None else directory
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        files = [os.open(directory / f"turn-{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(n)]
    except OSError:
        yield False
        return
    try:
        yield _take_one(files, time.monotonic() + max_wait_s)
    finally:
        for fd in files:
            os.close(fd)  # closing the descriptor releases its lock


def _take_one(files: list[int], deadline: float) -> bool:
    """Lock one of `files` (non-blocking tries, every POLL_S) before `deadline`; whether one was locked."""
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
