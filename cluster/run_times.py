"""How long a run took, across launches and restarts. Pure: the records come from RUN_DIR/starts.jsonl
(cluster/rundir.py `note_start`), one per launch (`pstrain launch`, `train --standalone`) and one per
start of the chief (its first start, a restart by the launcher, a resume by the same command again)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunTimes:
    total_s: float  # since the run's first launch
    launch_s: float  # since this launch (this invocation of the command)
    restarts: int  # chief starts after the first: restarts by the launcher and resumes by the operator

    @property
    def resumed(self) -> bool:
        return self.restarts > 0 or self.total_s - self.launch_s > 1e-6


def run_times(records: Sequence[dict[str, Any]], now: float) -> RunTimes:
    """The times of a run from its start records (`event` "launch" or "chief", `time` in seconds since
    the epoch); a run without records started `now`. A chief started by no launch that pstrain recorded
    (`pstrain task`, Slurm) counts its own start as its launch."""
    times = [float(r["time"]) for r in records if isinstance(r.get("time"), (int, float))]
    launches = [float(r["time"]) for r in records if r.get("event") == "launch" and isinstance(r.get("time"), (int, float))]
    chiefs = [r for r in records if r.get("event") == "chief"]
    first = min(times, default=now)
    this = launches[-1] if launches else (max(times) if times else now)
    return RunTimes(total_s=max(now - first, 0.0), launch_s=max(now - this, 0.0), restarts=max(len(chiefs) - 1, 0))


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def done_phrase(times: RunTimes) -> str:
    """`done in 2.6s`, or for a run that resumed or restarted
    `done in 26.7s since the first launch (this launch 3.1s, 1 restart)`."""
    if not times.resumed:
        return f"done in {times.total_s:.1f}s"
    return (
        f"done in {times.total_s:.1f}s since the first launch "
        f"(this launch {times.launch_s:.1f}s, {plural(times.restarts, 'restart')})"
    )


def done_fields(times: RunTimes) -> dict[str, float | int]:
    """What metrics.jsonl's done line records of the times."""
    return {"wall_seconds": round(times.total_s, 3), "launch_seconds": round(times.launch_s, 3), "restarts": times.restarts}
