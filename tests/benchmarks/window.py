"""One timing definition for every peer (pure): start-up and step time from applied global steps.

A peer's run is a list of samples `(applied global steps, wall-clock time)`, taken whenever the peer
learns how many global steps have been applied: pstrain at the end of each block (so the gaps between
blocks count), TF1 from the sync token each run returns (the global step after an apply, not a
worker's own run count), TF2 async from the optimizer's iterations on the ps after each closure (a
global step = one global batch = `workers` updates), MultiWorkerMirrored after each call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def running_max(samples: Iterable[Sequence[float]]) -> list[tuple[float, float]]:
    """Samples sorted by time, each step the most seen by then (several reporters merge into one)."""
    out: list[tuple[float, float]] = []
    for step, wall in sorted(((float(s), float(t)) for s, t in samples), key=lambda p: p[1]):
        out.append((max(step, out[-1][0]) if out else step, wall))
    return out


def block_ends(records: Iterable[dict]) -> list[tuple[float, float]]:
    """pstrain's metrics.jsonl -> one sample per block: (steps applied, the wall time its last record
    was written). Step records count from 0; a block's records are written together at its end and
    share its "seconds" (the block's mean), which is how blocks are told apart. Two adjacent blocks
    that happen to share it merge into one sample, which is still a true one."""
    out: list[tuple[float, float]] = []
    previous = None
    for r in records:
        if "step" not in r or "event" in r:
            continue
        sample = (r["step"] + 1, r["time"])
        if out and r["seconds"] == previous:
            out[-1] = sample
        else:
            out.append(sample)
        previous = r["seconds"]
    return out


def measure(samples: Iterable[Sequence[float]], steps: int, t_launch: float) -> dict:
    """{"startup_s": launch to the first applied global step, "step_s": wall seconds per applied
    global step over the window, "window": [first, last] step}. The window runs from the first sample
    at or past the run's half (`steps // 2`) to the last sample, so it spans whole blocks, closures
    and calls, gaps included; a run too short for that falls back to its first applied step."""
    points = [p for p in running_max(samples) if p[0] >= 1]
    if len(points) < 2:
        raise ValueError(f"window.measure: need two samples of applied steps, got {points}")
    first, last = points[0], points[-1]
    if last[0] <= first[0]:
        raise ValueError(f"window.measure: no step applied after the first, samples {points}")
    inside = [p for p in points[:-1] if p[0] >= steps // 2 and p[0] < last[0]]
    anchor = inside[0] if inside else first
    return {
        "startup_s": first[1] - t_launch,
        "step_s": (last[1] - anchor[1]) / (last[0] - anchor[0]),
        "window": [anchor[0], last[0]],
    }
