"""A task's lifetime under its supervisor: it ends with the supervisor (Linux), set up inside the
task itself; and the chief, started with the servers, waits for the launcher's word that they are up.

Doing it in the task rather than in a `preexec_fn` keeps Python code out of the window between
fork() and exec() in the launcher, which runs gRPC threads (see cluster/cli.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

PARENT_ENV = "PSTRAIN_PARENT_PID"
READY_ENV = "PSTRAIN_READY_FILE"  # the chief connects to the cluster once this file exists
PR_SET_PDEATHSIG = 1


def wait_until_ready(timeout_s: float) -> bool:
    """Block until the file named in $PSTRAIN_READY_FILE exists (at once when it is not set); False
    after `timeout_s`. The launcher creates it once every ps and worker registered."""
    path = os.environ.get(READY_ENV)
    deadline = time.monotonic() + timeout_s
    while path and not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def die_with_parent() -> None:
    """SIGKILL this process when the supervisor named in $PSTRAIN_PARENT_PID dies."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the supervisor died before we got here
        os._exit(1)
