"""The one stop trap: SIGINT/SIGTERM (or a programmatic request) become "stop at the next safe point".

Used by the launcher, `pstrain node` and the chief. Handlers are installed on entry and the previous
ones restored on exit, so nesting and tests in one process stay clean. The stop signals are unblocked
in the entering thread for as long: a process may start with them blocked (a task under a Ray actor
inherits Ray's blocked SIGINT), and a blocked signal never reaches its handler.
"""

from __future__ import annotations

import signal
import time
from types import FrameType, TracebackType

from cluster.errors import signal_exit_code, signal_name

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
WAIT_SLICE_S = 0.05  # how late `StopTrap.wait` notices a stop at most


class StopTrap:
    """`with StopTrap() as stop: ... if stop.requested: return stop.exit_code`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.cause = ""  # what asked for the stop, as the console says it: "Ctrl-C", "SIGTERM", "pstrain stop from HOST"
        self.commanded = False  # asked for by a command (`pstrain stop`), not by a signal to this process
        self._previous: dict[int, object] = {}
        self._mask: set[signal.Signals] = set()

    def __enter__(self) -> StopTrap:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        self._mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        self.rearm(self._previous)
        self._previous = {}

    def handlers(self) -> dict[int, object]:
        """The handlers now installed for the stop signals (for `rearm` after a library replaced them)."""
        return {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    @staticmethod
    def rearm(handlers: dict[int, object]) -> None:
        """Install `handlers` again (Ray's `ray.init` replaces the SIGTERM handler with its own exit)."""
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.request(signum)

    def request(self, signum: int = signal.SIGTERM, cause: str = "") -> None:
        """Ask for a stop as if `signum` had arrived; the first request wins. `cause` (a command such as
        "pstrain stop from HOST") marks the stop as commanded: it exits 0 once it checkpointed cleanly."""
        if self.signum is None:
            self.signum = signum
            self.cause, self.commanded = cause or cause_of(signum), bool(cause)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, but return as soon as a stop is requested; returns `requested`.

        Short sleeps, not a threading.Event: the signal handler would have to set the Event, and
        Event.set deadlocks when the signal interrupts the same thread inside Event.wait's lock.
        """
        deadline = time.monotonic() + seconds
        while not self.requested and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, WAIT_SLICE_S))
        return self.requested

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process stopped by it."""
        assert self.signum is not None, "exit_code is only defined once a stop was requested"
        return signal_exit_code(self.signum)

    @property
    def name(self) -> str:
        return signal_name(self.signum) if self.signum is not None else ""


def cause_of(signum: int) -> str:
    """How the console names a stop signal: "Ctrl-C" for SIGINT, else its name ("SIGTERM")."""
    return "Ctrl-C" if signum == signal.SIGINT else signal_name(signum)
