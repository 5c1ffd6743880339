"""A memory limit for one task of a test's run: a cgroup the test makes, moves that task's pid into, and
removes (v1's memory controller or v2's `memory.max`). `make` returns None where no cgroup can be made
here (not root, no memory controller): the caller then measures instead, and says so."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


@dataclass
class MemoryLimit:
    path: Path
    version: int
    limit: int
    admitted: set[int] = field(default_factory=set)

    def admit(self, pid: int) -> None:
        """Move process `pid` (all its threads; its children to come) into the limited cgroup. What it
        held before stays charged where it was (v1 here refuses `move_charge_at_immigrate`, v2 has none):
        admit a task as it starts."""
        if pid not in self.admitted:
            (self.path / "cgroup.procs").write_text(str(pid))
            self.admitted.add(pid)

    def peak(self) -> int | None:
        """The cgroup's high-water mark of charged memory in bytes (None where the kernel keeps none)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / name).read_text())
        return None

    def oom_kills(self) -> int:
        """How many processes the kernel killed in this cgroup for want of memory."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone (a few tries: a killed task leaves it late)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def make(limit: int) -> MemoryLimit | None:
    """An empty cgroup limited to `limit` bytes, or None where none can be made here."""
    name = f"pstrain-test-{os.getpid()}"
    for version, parent, file in ((1, ROOT / "memory", "memory.limit_in_bytes"), (2, ROOT, "memory.max")):
        if version == 2 and "memory" not in _read(ROOT / "cgroup.subtree_control").split():
            continue
        if not (parent / "cgroup.procs").exists():
            continue
        path = parent / name
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / file).write_text(str(limit))
            if version == 1:  # no swap either: the limit is on memory itself
                with contextlib.suppress(OSError):
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            return MemoryLimit(path, version, limit)
        except OSError:
            path.rmdir()
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
