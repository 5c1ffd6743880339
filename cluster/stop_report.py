"""The one console line that ends a stopped run, and its exit code. Pure: no processes, no files.

A stop is said without the word `error`: what stopped the run (Ctrl-C, SIGTERM, `pstrain stop` from
HOST), the step it stopped after, and what to run next. A commanded stop (`pstrain stop`) that ended
cleanly exits 0; a signal keeps 128+N, as a shell reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.errors import EXIT_OK


@dataclass(frozen=True)
class StopOutcome:
    line: str
    exit_code: int


def resume_hint(checkpoint: int | None) -> str:
    """What to run next, from the run's latest complete checkpoint step (None: there is none)."""
    if checkpoint is None:
        return "run the same command to start (no checkpoint yet)"
    return f"run the same command to resume from checkpoint step {checkpoint}"


def stop_outcome(cause: str, commanded: bool, stop_code: int, checkpoint: int | None, how: str) -> StopOutcome:
    """The line and exit code of a run that stopped on request. `stop_code`: 128+N of the stop's signal;
    `checkpoint`: the latest complete checkpoint's step after the stop; `how` the chief ended:
    "saved" (it checkpointed at its stop step), "start-up" (it had not trained yet in this launch),
    or what went wrong (e.g. "killed after 8s"): then the last complete checkpoint stands."""
    clean = how in ("saved", "start-up")
    code = EXIT_OK if commanded and clean else stop_code
    if how == "saved" and checkpoint is not None:
        line = f"pstrain: stopped by {cause} after step {checkpoint}; checkpoint saved, {resume_hint(checkpoint)}"
        return StopOutcome(line, code)
    if clean:
        return StopOutcome(f"pstrain: stopped by {cause} during start-up, before any step ran; {resume_hint(checkpoint)}", code)
    return StopOutcome(f"pstrain: stopped by {cause}; the chief could not checkpoint ({how}); {resume_hint(checkpoint)}", code)
