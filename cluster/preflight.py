"""Before anything starts: can the run dir be written, and has it room? (the launcher before any task
starts, `train --standalone` before it trains, the chief before it restores).

A failed check is one line naming the path, what is wrong and the fix, exit 2 (`ConfigError`):
the same wording a failed write gets mid-run (cluster/errors.py `write_error`).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from cluster.errors import ConfigError, write_error
from cluster.rundir import RunDir, newest_checkpoint_bytes

MIN_FREE_BYTES = 1 << 20  # refused below this, or below room for one checkpoint of the newest one's size


def existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (where a missing directory will be made)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def write_problem(directory: Path) -> OSError | None:
    """Why a new file cannot be made in `directory` (which exists), or None: one is made and removed."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".pstrain-preflight-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        return e
    return None


def run_dir_paths(layout: RunDir) -> list[Path]:
    """What a run writes: the run dir, its checkpoints/ and logs/, and the export path (saved_model)."""
    return [layout.path, layout.checkpoints, layout.logs, layout.saved_model]


def file_in_the_way(run_dir: RunDir) -> str:
    """The one line for a file where the run dir (or one of its directories) goes; "" when there is none."""
    for path in run_dir_paths(run_dir):
        found = existing(path)
        if found.is_dir() or not found.exists():
            continue
        if found == run_dir.path:
            return f"--run-dir: {run_dir.path} is a file, not a directory; give a directory (a missing one is made)"
        if found == path:
            return f"--run-dir: {path} is a file where the run keeps a directory; move it away or use another --run-dir"
        return f"--run-dir: {run_dir.path} is under {found}, which is a file; give a path whose parents are directories"
    return ""


def check_writable(run_dir: RunDir) -> None:
    """Refuse (ConfigError, one line) a run dir where a run could not write or has no room."""
    if problem := file_in_the_way(run_dir):
        raise ConfigError(problem)
    need = max(MIN_FREE_BYTES, newest_checkpoint_bytes(run_dir.checkpoints))
    for path in dict.fromkeys(existing(p) for p in run_dir_paths(run_dir)):
        problem = write_problem(path)
        if problem is not None:
            found = write_error(problem, path, gone=False)
            reason = problem.strerror or str(problem)
            if found is None:
                raise ConfigError(f"--run-dir: cannot write {path} ({reason}); use another --run-dir") from None
            raise ConfigError(f"--run-dir: {found} ({reason})") from None
        free = shutil.disk_usage(path).free
        if free < need:
            error = OSError(errno.ENOSPC, "No space left on device")
            raise ConfigError(
                f"--run-dir: {write_error(error, path)} ({free / 2**20:.1f} MiB free, a checkpoint needs {need / 2**20:.1f} MiB)"
            ) from None
