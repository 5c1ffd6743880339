"""TensorBoard event files from the records of metrics.jsonl: RUN_DIR/tensorboard/{train,eval}.

Written with the tensorboard package's own event writer (protobuf + a background thread, no TensorFlow
op on the chief's step path). A resumed run first drops every event at or past the restored step from
the existing event files (rewritten as tmp + rename), as MetricsLog does with metrics.jsonl, so a
restart never leaves two curves over the same steps, whatever reader (TensorBoard, EventAccumulator)
looks at them.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.summary.writer.record_writer import RecordWriter

SKIPPED = {"step", "time", "event", "steps"}  # bookkeeping fields, not curves


def train_scalars(record: dict[str, Any], examples_per_step: int | None, gradients: dict[int, int]) -> dict[str, float]:
    """The train curves of one step record (pure). `gradients`: gradients applied per worker so far."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in SKIPPED or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out[key] = float(value)
        elif key == "timing" and isinstance(value, dict):
            out.update({f"timing/{phase}": float(v) for phase, v in value.items() if isinstance(v, int | float)})
    seconds = record.get("seconds")
    if isinstance(seconds, int | float) and seconds > 0:
        out["steps_per_second"] = 1.0 / seconds
        if examples_per_step:
            out["examples_per_second"] = examples_per_step / seconds
    out.update({f"gradients_applied/worker_{w}": float(n) for w, n in sorted(gradients.items())})
    return out


def eval_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The eval curves of an "eval" or "done" record (pure): its numeric fields, `eval_` prefix dropped."""
    out = {}
    for key, value in record.items():
        if key in SKIPPED or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if record.get("event") == "done" and not key.startswith("eval_"):
            continue  # the done line's totals (wall_seconds, stale_dropped_total) are not eval curves
        out[key.removeprefix("eval_")] = float(value)
    return out


def count_gradients(gradients: dict[int, int], record: dict[str, Any]) -> None:
    for worker in record.get("workers", []):
        gradients[worker] = gradients.get(worker, 0) + 1


def read_events(data: bytes) -> tuple[list[Event], bool]:
    """The events of one file's bytes (TFRecord framing), and whether they end cleanly (a record cut
    short by a crash ends them)."""
    events, at = [], 0
    while at + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        start, end = at + 12, at + 12 + length
        if end + 4 > len(data):
            break
        events.append(Event.FromString(data[start:end]))
        at = end + 4
    return events, at == len(data)


def truncate_events(log_dir: Path, keep_before: int) -> None:
    """Drop every event at step >= `keep_before` (and a tail cut short by a crash) from the event files
    in `log_dir`; each file changed is rewritten as tmp + rename."""
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        events, clean = read_events(path.read_bytes())
        kept = [e for e in events if e.HasField("file_version") or e.step < keep_before]
        if clean and len(kept) == len(events):
            continue
        if all(e.HasField("file_version") for e in kept):
            path.unlink()
            continue
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            writer = RecordWriter(f)
            for event in kept:
                writer.write(event.SerializeToString())
            writer.flush()
        tmp.replace(path)


class TensorBoardLog:
    """Train and eval event writers fed with metrics.jsonl's records."""

    def __init__(self, log_dir: Path, resume_step: int, examples_per_step: int | None, history: list[dict[str, Any]]):
        """`history`: the step records kept from before `resume_step` (to continue the per-worker counts)."""
        self.examples_per_step = examples_per_step
        self.gradients: dict[int, int] = {}
        for record in history:
            count_gradients(self.gradients, record)
        self.writers: dict[str, EventFileWriter] = {}
        for name in ("train", "eval"):
            (log_dir / name).mkdir(parents=True, exist_ok=True)
            truncate_events(log_dir / name, resume_step)
            self.writers[name] = EventFileWriter(str(log_dir / name), max_queue_size=100, flush_secs=30)

    def write(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event is None and "step" in record:
            count_gradients(self.gradients, record)
            self._add(
                "train", int(record["step"]), record.get("time"), train_scalars(record, self.examples_per_step, self.gradients)
            )
        elif event in ("eval", "done"):
            step = record.get("step", record.get("steps"))
            if isinstance(step, int):
                self._add("eval", step, record.get("time"), eval_scalars(record))

    def _add(self, writer: str, step: int, wall_time: float | None, scalars: dict[str, float]) -> None:
        if not scalars:
            return
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()])
        event = Event(step=step, wall_time=float(wall_time if wall_time is not None else time.time()), summary=summary)
        self.writers[writer].add_event(event)

    def flush(self) -> None:
        for writer in self.writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
