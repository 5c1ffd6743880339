"""A task ends with the supervisor that started it (Linux), set up inside the task itself.

Doing it in the task rather than in a `preexec_fn` keeps Python code out of the window between
fork() and exec() in the launcher, which runs gRPC threads (see cluster/cli.py).
"""

from __future__ import annotations

import ctypes
import os
import signal

PARENT_ENV = "PSTRAIN_PARENT_PID"
PR_SET_PDEATHSIG = 1


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
