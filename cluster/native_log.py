"""Native code's start-up lines into the run's log, not onto the console.

TensorFlow's C++ runtime writes its start-up lines (oneDNN, absl's "before InitializeLog", cuInit,
cpu_feature_guard) straight to file descriptor 2, at import and at its first ops: no Python logger
sees them. `native_stderr_to` points descriptor 2 at the log for as long as it lasts, and gives
Python's `sys.stderr` a descriptor of its own on the console, so pstrain's own lines stay there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def native_stderr_to(log: Path) -> Iterator[None]:
    """Within: what is written to descriptor 2 (by C++ code or a child process) is appended to `log`;
    `sys.stderr` still reaches where descriptor 2 went before. Both are restored on exit."""
    sys.stderr.flush()
    console = os.dup(2)
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = sys.stderr
    os.dup2(target, 2)
    os.close(target)
    sys.stderr = open(console, "w", buffering=1, encoding=saved.encoding, errors="backslashreplace", closefd=False)  # noqa: SIM115
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr = saved
        os.dup2(console, 2)
        os.close(console)
