"""Pure failure policy: what the launcher does when a task exits. Decisions only; no processes, no sleeps.

Modelled on Ray Train's `FailurePolicy.make_decision`: the supervisor gathers facts, asks here, and
carries the answer out. Tested without processes (tests/cluster/test_policy.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.errors import EXIT_OK, EXIT_RESTARTABLE

MAX_BACKOFF_S = 8.0


@dataclass(frozen=True)
class Restart:
    """Start the task again after `delay_s` (exponential back-off: 1, 2, 4, 8, 8 ... s)."""

    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    """Stop retrying; `reason` completes "<task> exited with code N ...", e.g. "4 times; giving up"."""

    reason: str


@dataclass(frozen=True)
class Finish:
    """The run is over; the launcher exits with `exit_code`."""

    exit_code: int


@dataclass(frozen=True)
class RestartBudget:
    """A task's restarts that still count against `max_restarts`: those of the last `window_s` seconds."""

    used: int
    max_restarts: int
    window_s: float
    resets_at: float | None  # when the newest counted restart stops counting: the count is 0 again (None: it is)


def restart_budget(times: Sequence[float], now: float, max_restarts: int, window_s: float) -> RestartBudget:
    """The budget of a task restarted at `times` (seconds since the epoch), as of `now`."""
    counted = [t for t in times if now - t < window_s]
    return RestartBudget(len(counted), max_restarts, window_s, max(counted) + window_s if counted else None)


def budget_phrase(budget: RestartBudget) -> str:
    """How the console says when a budget resets, e.g. "the count resets at 22:31:05 (3 per 10 min)"."""
    window = f"{budget.window_s / 60:g} min" if budget.window_s >= 60 else f"{budget.window_s:g}s"
    per = f"{budget.max_restarts} per {window}"
    if budget.resets_at is None:
        return f"no restart counts now ({per})"
    return f"the count resets at {time.strftime('%H:%M:%S', time.localtime(budget.resets_at))} ({per})"


def restart_decision(restarts: int, max_restarts: int) -> Restart | GiveUp:
    """A ps or worker exited after `restarts` earlier restarts that still count (`restart_budget`)."""
    if restarts >= max_restarts:
        return GiveUp(f"{restarts + 1} times; giving up")
    return Restart(delay_s=min(2.0**restarts, MAX_BACKOFF_S))


def chief_decision(exit_code: int, restarts: int, max_restarts: int, stop_code: int | None) -> Restart | Finish:
    """The chief exited with `exit_code` after `restarts` restarts that still count (`restart_budget`).
    `stop_code` is set when the user asked the run to stop.

    A stop request ends the run: 0 when the chief still completed, else the stop's 128+N. The chief's
    "a task became unreachable" code (75) restarts it, bounded by `max_restarts`, so it resumes from
    its checkpoint once the lost task is back; every other code ends the run with that code.
    """
    if stop_code is not None:
        return Finish(EXIT_OK if exit_code == EXIT_OK else stop_code)
    if exit_code == EXIT_RESTARTABLE and restarts < max_restarts:
        return Restart(delay_s=0.0)
    return Finish(exit_code)


@dataclass(frozen=True)
class Kill:
    """End the task now (SIGKILL, by pid); it is then restarted like a task that died."""


@dataclass(frozen=True)
class EndRun:
    """Stop the run: the chief checkpoints, the launcher exits 1 saying why."""


def silent_task_decision(started_here: bool, running: bool) -> Kill | EndRun | None:
    """A ps or worker sent no heartbeat for `heartbeat_timeout`. One this launcher started (`started_here`)
    is hung, not cut off: killing it lets ClusterCoordinator re-run its closures elsewhere and the restart
    bring it back. One on another machine may only be unreachable, and cannot be killed from here: the
    run ends with a checkpoint. A local task that is no longer `running` is the restart policy's (None)."""
    if started_here:
        return Kill() if running else None
    return EndRun()


@dataclass(frozen=True)
class ReformWorkers:
    """Restart every worker, then the chief, which resumes from its checkpoint with a fresh collective group."""


@dataclass(frozen=True)
class CannotReform:
    """End the run: `reason` says why, and how to resume."""

    reason: str


def collectives_decision(dense: str, workers: int, workers_here: int) -> ReformWorkers | CannotReform | None:
    """A worker was lost, or the chief is to restart: what the other workers need (`train.dense`, the
    cluster's `workers`, and how many of them this launcher started).

    With "ps" nothing (None): ClusterCoordinator re-runs a lost worker's closures elsewhere, and a restarted
    chief reconnects to the running workers. With "allreduce" one lost worker aborts every survivor's
    collectives for good, in that process (../shared/notes/hybrid.md), and a restarted chief's collectives
    would meet them there: every worker restarts first, then the chief (ReformWorkers). Only a launcher
    that started every worker can do that; else the run ends (CannotReform), and the same command on every
    machine resumes it from the checkpoint.
    """
    if dense != "allreduce":
        return None
    if workers_here == workers:
        return ReformWorkers()
    return CannotReform(
        f'train.dense = "allreduce" forms its collectives again only among fresh workers, and {workers - workers_here} '
        f"of the {workers} workers run on other machines; run the same command on every machine again"
    )
