"""The launcher's console: its own lines (`say`, `say_stopped`), and what of a task's output reaches it
(pstrain's own lines and its progress bar).

Everything else a task prints (TensorFlow's C++ log lines such as `I0000 ... oneDNN custom
operations are on` or `E0000 ... failed call to cuInit`, absl and Python warnings, a job's own
prints, tracebacks) stays in the task's log file only (the supervisor writes every byte there).
"""

from __future__ import annotations

import re
import sys

from cluster.errors import report
from cluster.stop import StopTrap
from cluster.stop_report import stop_outcome

_PLAIN_PROGRESS = re.compile(r"step \d+/\d+ ")
_BAR = re.compile(r"\[[#.]*\] step \d+/\d+ ")


def for_console(line: str) -> bool:
    """Does one line of a task's output (without its \\r / \\n) belong on the console? Pure."""
    return line.startswith("pstrain") or bool(_PLAIN_PROGRESS.match(line)) or bool(_BAR.match(line))


ERASE_LINE = b"\x1b[K"  # ends every redraw of Progress's bar (chief/metrics.py)


class ConsoleFilter:
    """Feeds on a task's raw output chunks and returns the bytes to echo on the console.

    A line ends at \\n. A progress bar redraw is \\r, the bar, then ERASE_LINE (no \\n), so it is
    judged and shown as soon as it is complete, and whatever another writer appends after it (TF's
    stderr shares the stream) starts a line of its own. The \\n that ends a shown bar passes too.
    """

    def __init__(self) -> None:
        self._pending = b""
        self._bar_open = False  # the console's cursor sits at the end of a bar

    def feed(self, chunk: bytes) -> bytes:
        self._pending += chunk
        out = []
        while self._pending:
            start = 1 if self._pending.startswith(b"\r") else 0
            ends = [self._pending.find(b"\n", start), self._pending.find(b"\r", start)]
            if start and (erase := self._pending.find(ERASE_LINE)) >= 0:
                ends.append(erase + len(ERASE_LINE) - 1)
            cut = min((i for i in ends if i >= 0), default=-1)
            if cut < 0:
                break  # an unfinished line or redraw: wait for the rest
            end = cut if self._pending[cut : cut + 1] == b"\r" else cut + 1
            piece, self._pending = self._pending[:end], self._pending[end:]
            out.append(self._judge(piece))
        return b"".join(out)

    def _judge(self, piece: bytes) -> bytes:
        text = piece.decode("utf-8", "replace").strip("\r\n").removesuffix(ERASE_LINE.decode())
        if text == "" and piece.endswith(b"\n"):
            shown = self._bar_open  # the newline that closes a bar
            self._bar_open = False
            return piece if shown else b""
        if not for_console(text):
            return b""
        self._bar_open = piece.startswith(b"\r") and piece.endswith(ERASE_LINE)
        return piece


def say(text: str, error: bool = False, warning: bool = False) -> None:
    """A launcher line on the console: progress to stdout, problems (errors; warnings of a recovery) to stderr."""
    if error:
        report(text)
        return
    print(f"pstrain: {'warning: ' if warning else ''}{text}", file=sys.stderr if warning else sys.stdout, flush=True)


def say_stopped(stop: StopTrap, checkpoint: int | None, how: str) -> int:
    """The console line of a stopped run (cluster/stop_report.py); returns its exit code."""
    outcome = stop_outcome(stop.cause, stop.commanded, stop.exit_code, checkpoint, how)
    print(outcome.line, flush=True)
    return outcome.exit_code
