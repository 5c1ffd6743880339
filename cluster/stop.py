"""The one stop trap: SIGINT/SIGTERM (or a programmatic request) become "stop at the next safe point".

Used by the launcher, `pstrain node` and the chief. Handlers are installed on entry and the previous
ones restored on exit, so nesting and tests in one process stay clean.
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType

from cluster.errors import signal_exit_code, signal_name

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopTrap:
    """`with StopTrap() as stop: ... if stop.requested: return stop.exit_code`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopTrap:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.request(signum)

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop as if `signum` had arrived; the first request wins."""
        if self.signum is None:
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process stopped by it."""
        assert self.signum is not None, "exit_code is only defined once a stop was requested"
        return signal_exit_code(self.signum)

    @property
    def name(self) -> str:
        return signal_name(self.signum) if self.signum is not None else ""
