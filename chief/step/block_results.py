"""Pure decisions of the cluster engine's dispatch (chief/step/dispatch.py), kept apart to be tested alone.

- The packed results of a block: `apply_widths` is the layout the apply loop writes
  (worker/ps/apply.py), `unpack_applied` reads it, and `block_results` turns it, with the worker
  loops' packed rows, into one `StepResult` per step the apply got to, doing a stream's epoch
  bookkeeping step by step (each step's batches are observed before that step's epoch is asked).
- `lean_applied`: a lean block's closures (the hybrid step with no ps on a step's path) in the same forms.
- `stall_decision`: whether a block whose global step has not moved is to be ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from chief.step.engine import StepResult, first_nonfinite

STALL_MIN_S = 10.0  # a block whose global step has not moved this long (and STALL_STEPS fast steps) is ended
STALL_STEPS = 20


def apply_widths(slots: int, values: int) -> tuple[int, ...]:
    """Columns per step of the apply's packed result: loss, chosen slots, their workers, late, finite, applied."""
    return (1, slots, slots, 1, values, 1)


def unpack_applied(packed: np.ndarray, widths: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """The apply's [steps, sum(widths)] float64 result as (losses, chosen, workers, late, finite, proceeded)."""
    losses, chosen, workers, late, finite, proceeded = np.split(packed, np.cumsum(widths)[:-1], axis=1)
    return (
        losses[:, 0].astype(np.float32),
        chosen.astype(bool),
        workers.astype(np.int64),
        late[:, 0].astype(np.int64),
        finite.astype(bool),
        proceeded[:, 0].astype(bool),
    )


class StreamEpochs(Protocol):
    """A stream source's epoch bookkeeping (worker/input/streams.py: StreamSource)."""

    def observe(self, positions) -> None: ...

    def epoch_of(self, step: int) -> int: ...


def block_results(
    applied: tuple[np.ndarray, ...],
    closures: dict[int, np.ndarray],
    first: int,
    names: Sequence[str],
    stream: StreamEpochs | None,
    read_ahead: bool,
    timing: dict[str, float],
) -> list[StepResult]:
    """One StepResult per step the apply proceeded with. `applied`: `unpack_applied`'s tuple; `closures`:
    per slot whose closure finished, its packed result (the worker, then [j, epoch, index, hit] per step
    from `first`); `names`: the averaged values' names (chief/step/engine.py: value_names); `stream`:
    the source when it is a stream (its chosen batches are observed, step by step), else None;
    `read_ahead`: whether workers read ahead; `timing`: each step's share of the block, per phase."""
    losses, chosen, workers, late, finite, proceeded = applied
    slot_worker = {slot: int(out[0]) for slot, out in closures.items()}
    per_step = {slot: out[1:].reshape(-1, 4) for slot, out in closures.items()}  # [j, epoch, index, hit] per step
    steps = []
    for i in np.flatnonzero(proceeded):
        picked = np.flatnonzero(chosen[i])
        # With backups the apply knows each chosen slot's worker; else the closures said.
        found = {int(workers[i][s]) if workers[i][s] >= 0 else slot_worker.get(int(s), -1) for s in picked}
        bad = first_nonfinite(finite[i].tolist(), names)
        # The chosen slots' [j, epoch, index, hit] rows of this step (a closure's rows start at `first`).
        read = [per_step[s][i] for s in picked if s in per_step and i < len(per_step[s])]
        hits = int(sum(r[3] for r in read))
        epoch = reread = None
        if stream is not None:  # their batches' epochs, and how many were read from a fresh pipeline
            stream.observe([r[:3] for r in read])
            epoch, reread = stream.epoch_of(first + int(i)), hits
        steps.append(
            StepResult(
                loss=float(losses[i]),
                aggregated=len(picked),
                stale_dropped=int(late[i]),
                workers=sorted(found - {-1}),
                applied=bad is None,
                nonfinite=bad,
                read_ahead=hits if read_ahead else None,
                epoch=epoch,
                reread=reread,
                timing=dict(timing),
            )
        )
    return steps


def lean_applied(
    closures: dict[int, np.ndarray], count: int, columns: int, slots: int
) -> tuple[tuple[np.ndarray, ...], dict[int, np.ndarray]]:
    """A lean block's closures (worker/replica/loop.py `lean_loop`: the worker, then `columns` per step
    run) as the apply's unpacked tuple and the closures' rows in `block_results`'s form. Every closure
    ran the same steps to the same decisions (the workers decide from the same exchanged values): a
    step that saw a stop is no result, a step whose means were not finite is a withheld one.
    Raises RuntimeError when the closures disagree (not one of `slots` each, or different decisions)."""
    rows = {slot: out[1:].reshape(-1, columns) for slot, out in closures.items()}
    decided = {rows[slot][:, 4:].tobytes() for slot in rows}
    if sorted(rows) != list(range(slots)) or len(decided) != 1 or len(rows[0]) > count:
        raise RuntimeError(f"the lean block's closures disagree: slots {sorted(rows)}, {len(decided)} different decisions")
    steps = rows[0]
    proceeded = steps[:, 6] == 0  # [.., loss bits, finite, stopped]
    n = int(proceeded.sum())
    losses = steps[:n, 4].astype(np.int32).view(np.float32)
    applied = (
        losses,
        np.ones([n, slots], bool),
        np.full([n, slots], -1, np.int64),  # each slot's worker: from its closure (block_results)
        np.zeros([n], np.int64),
        steps[:n, 5:6].astype(bool),
        np.ones([n], bool),
    )
    return applied, {slot: np.concatenate([out[:1], rows[slot][:, :4].ravel()]) for slot, out in closures.items()}


def stall_decision(step: int, progress: tuple[int, float], now: float, step_s: float) -> tuple[tuple[int, float], bool]:
    """(the new (global step, when it last moved), whether it has not moved for too long) at time `now`,
    given the global `step` read now, the last `progress` and the fastest step seen (`step_s` seconds).
    A block stalls when a worker fails or hangs: ClusterCoordinator re-runs the worker's closure only
    after the closures in flight end, and those wait at the gate for the failed slot."""
    if step != progress[0]:
        return (step, now), False
    return progress, now - progress[1] > max(STALL_MIN_S, STALL_STEPS * step_s)
