"""A benchmark module's command line: its main, or one of its peer roles as a process.

The harness starts a role process as `python -m tests.benchmarks.X ROLE SIZE GLOBAL_BATCH STEPS [K]`
(bench.launch_on); anything else (no argument, or a first one that starts with "-") is the module's
own main. No TensorFlow is imported here: a main's --help and its refusals stay quick.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn


def role_argv(argv: list[str]) -> tuple[str, str, int, int, int | None]:
    """A role process's arguments: ROLE SIZE GLOBAL_BATCH STEPS [K] (tests/benchmarks/bench.launch_on)."""
    k = int(argv[4]) if len(argv) > 4 else None
    return argv[0], argv[1], int(argv[2]), int(argv[3]), k


def role_process(workload: str, roles: dict[str, Callable[[str, int, int], None]]) -> NoReturn:
    """Run the role sys.argv names: one of `roles` (the module's own: ROLE(size, batch, steps)), else
    a TF2 peer of tests/benchmarks/fair.py on the workload module `workload` with its K; then exit 0
    at once (the coordinator's threads would otherwise hold the exit)."""
    role, size, batch, steps, k = role_argv(sys.argv[1:])
    if role in roles:
        roles[role](size, batch, steps)
    else:
        from tests.benchmarks.fair import run_role

        run_role(workload, role, size, batch, steps, k)
    sys.stdout.flush()
    os._exit(0)


def main_or_role(workload: str, roles: dict[str, Callable[[str, int, int], None]], main: Callable[[], int]) -> NoReturn:
    """A module's `__main__`: a role process where the first argument is a role (role_process), else
    `main()`'s exit status, ended by SIGTERM as by Ctrl-C (`end_on_sigterm`)."""
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        role_process(workload, roles)
    end_on_sigterm()
    raise SystemExit(main())


def end_on_sigterm() -> None:
    """A benchmark's main ends on SIGTERM as on Ctrl-C: through its finally blocks, which stop the
    processes of its runs (and, with --link, remove their hosts); exit 143."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
