"""What of a task's output reaches the launcher's console: pstrain's own lines and its progress bar.

Everything else a task prints (TensorFlow's C++ log lines such as `I0000 ... oneDNN custom
operations are on` or `E0000 ... failed call to cuInit`, absl and Python warnings, a job's own
prints, tracebacks) stays in the task's log file only (the supervisor writes every byte there).
"""

from __future__ import annotations

import re

_PLAIN_PROGRESS = re.compile(r"step \d+/\d+ ")
_BAR = re.compile(r"\[[#.]*\] step \d+/\d+ ")


def for_console(line: str) -> bool:
    """Does one line of a task's output (without its \\r / \\n) belong on the console? Pure."""
    return line.startswith("pstrain") or bool(_PLAIN_PROGRESS.match(line)) or bool(_BAR.match(line))


class ConsoleFilter:
    """Feeds on a task's raw output chunks and returns the bytes to echo on the console.

    A line ends at \\n; a progress bar redraws with a leading \\r and no \\n, so a pending piece that
    starts with \\r is judged (and shown) as soon as it arrives. The \\n that ends a bar passes too.
    """

    def __init__(self) -> None:
        self._pending = b""
        self._bar_open = False  # the console's cursor sits at the end of a bar
        self._continuing = False  # the rest of a bar already shown in part is still arriving

    def feed(self, chunk: bytes) -> bytes:
        self._pending += chunk
        out = []
        while self._pending:
            start = 1 if self._pending.startswith(b"\r") and not self._continuing else 0
            cut = min((i for i in (self._pending.find(b"\n", start), self._pending.find(b"\r", start)) if i >= 0), default=-1)
            if self._continuing:
                end = len(self._pending) if cut < 0 else cut
                out.append(self._pending[:end])
                self._pending, self._continuing = self._pending[end:], cut < 0
                continue
            if cut < 0:
                if start and _BAR.match(
                    self._pending[1:].decode("utf-8", "replace")
                ):  # a bar being drawn: show it now, not at the next redraw
                    out.append(self._judge(self._pending))
                    self._pending, self._continuing = b"", self._bar_open
                break  # else an unfinished line: wait for the rest
            end = cut + 1 if self._pending[cut : cut + 1] == b"\n" else cut
            piece, self._pending = self._pending[:end], self._pending[end:]
            out.append(self._judge(piece))
        return b"".join(out)

    def _judge(self, piece: bytes) -> bytes:
        text = piece.decode("utf-8", "replace").strip("\r\n")
        if text == "" and piece.endswith(b"\n"):
            shown = self._bar_open  # the newline that closes a bar
            self._bar_open = False
            return piece if shown else b""
        if not for_console(text):
            return b""
        self._bar_open = piece.startswith(b"\r") and not piece.endswith(b"\n")
        return piece
