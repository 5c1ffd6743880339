"""metrics.jsonl (one JSON line per step, then a "done" line) and the console progress."""

from __future__ import annotations

import json
import sys
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

from chief.tensorboard import TensorBoardLog
from cluster.errors import writing
from cluster.rundir import RunDir, read_records


class MetricsLog:
    """Append-only step log at `path` (RunDir.metrics); on resume, lines past the restored step are dropped first. Every record
    also goes to the TensorBoard event files under the same run dir (chief/tensorboard.py)."""

    def __init__(
        self,
        run_dir: RunDir,
        resume_step: int,
        examples_per_step: int | None = None,
        learning_rate: Callable[[int], float | None] | None = None,
    ):
        """Into `run_dir`'s metrics.jsonl and tensorboard/; `learning_rate(step)`, where given, adds "learning_rate"
        to every step record."""
        path = run_dir.metrics
        self.path, self.tensorboard_dir = path, run_dir.tensorboard
        self.learning_rate = learning_rate
        history = [r for r in read_records(path) if "step" in r and r["step"] < resume_step]
        tmp = path.with_suffix(".tmp")
        with writing(path):
            tmp.write_text("".join(f"{json.dumps(record)}\n" for record in history))
            tmp.replace(path)
            self._file = open(path, "a", buffering=1)
        with writing(self.tensorboard_dir):
            self.tensorboard = TensorBoardLog(self.tensorboard_dir, resume_step, examples_per_step, history)

    def write(self, record: dict[str, Any]) -> None:
        if self.learning_rate and "step" in record and "event" not in record:
            rate = self.learning_rate(record["step"])
            record = record if rate is None else {**record, "learning_rate": rate}
        with writing(self.path):
            self._file.write(json.dumps(record) + "\n")
        with writing(self.tensorboard_dir):
            self.tensorboard.write(record)

    def flush(self) -> None:
        """At checkpoints: what is on disk covers the checkpointed steps."""
        with writing(self.path):
            self._file.flush()
        with writing(self.tensorboard_dir):
            self.tensorboard.flush()

    def close(self) -> None:
        with writing(self.path):
            self._file.close()
        with writing(self.tensorboard_dir):
            self.tensorboard.close()


def learning_rate_fn(optimizer: Any) -> Callable[[int], float | None]:
    """step -> the optimizer's learning rate: a schedule is evaluated at the step (locally), a fixed
    rate is read once (on a cluster it is a variable on a ps); None where the optimizer has none."""
    import tf_keras

    from chief.contract.framework import learning_rate_schedule

    if (scheduled := learning_rate_schedule(optimizer)) is not None:  # Keras 3
        return scheduled
    hyper = getattr(optimizer, "_hyper", {}).get("learning_rate")  # tf_keras.optimizers.legacy.*
    if hyper is None:
        hyper = getattr(optimizer, "learning_rate", None)
    if isinstance(hyper, tf_keras.optimizers.schedules.LearningRateSchedule):
        return lambda step: float(hyper(step))
    try:
        value = float(hyper.numpy() if hasattr(hyper, "numpy") else hyper)
    except (TypeError, ValueError, AttributeError):
        return lambda step: None
    return lambda step: value


def format_eta(seconds: float) -> str:
    """0:09, 1:01, 1:02:05."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """A one-line bar on a terminal, else a line every ~5 % of the run; both with the rate (steps/s
    over the last RATE_WINDOW steps) and the time left at that rate."""

    RATE_WINDOW = 20

    def __init__(self, total: int, start: int, tty: bool, out: TextIO = sys.stdout, epochs=None):
        """`epochs`: the run's Epochs (chief/epochs.py), when it trains by epochs: each line shows the epoch."""
        self.total, self.start, self.tty, self.out, self.epochs = total, start, tty, out, epochs
        self.every = max(1, total // 20)
        self.recent: deque[float] = deque(maxlen=self.RATE_WINDOW)  # seconds of the last steps

    def update(self, step: int, loss: float, examples_per_s: float, aggregated: int, seconds: float) -> None:
        """`seconds`: the step's share of its block's time. A block's steps are reported together, so the
        rate comes from these shares, not from when the lines are written; the run's first step, which
        traces every function, is left out of it."""
        done = step + 1
        if done > self.start + 1:
            self.recent.append(seconds)
        text = f"epoch {self.epochs.epoch_of(step) + 1}/{self.epochs.epochs}  " if self.epochs else ""
        text += f"step {done}/{self.total}  loss {loss:.4f}  aggregated {aggregated}  {examples_per_s:,.0f} examples/s"
        if (seconds_total := sum(self.recent)) > 0:
            rate = len(self.recent) / seconds_total
            text += f"  {rate:.1f} steps/s  ETA {format_eta((self.total - done) / rate)}"
        if self.tty:
            filled = int(30 * done / self.total)
            self.out.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {text}\x1b[K")  # erase what a longer line left
            if done == self.total:
                self.out.write("\n")
        elif done % self.every == 0 or done == self.total or done == self.start + 1:
            self.out.write(text + "\n")
        self.out.flush()

    def message(self, text: str) -> None:
        if self.tty:
            self.out.write("\n")
        self.out.write(text + "\n")
        self.out.flush()
