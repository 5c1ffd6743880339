"""One task's row of `pstrain status`, typed once: the Registry builds it, the ControlPlane's TaskStatus
message carries it, `pstrain status --json` prints it as a dict and status_table as a line."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cluster.control.proto import control_pb2 as pb

# A task that never registered has only these (the rest would be zeros that mean nothing).
MISSING_FIELDS = ("task", "state", "address", "heartbeat_age_s", "restarts", "restarts_reset_at")


@dataclass(frozen=True)
class TaskRow:
    task: str  # "worker:1"
    state: str  # "missing", "lost", or the state the task reports
    address: str
    heartbeat_age_s: float  # -1.0 where it never registered
    restarts: int = 0  # restarts counting against the budget
    restarts_reset_at: float = 0.0  # wall clock when the oldest stops counting
    host: str = ""
    hostname: str = ""
    pid: int = 0
    step: int = 0
    steps_per_s: float = 0.0
    gradients: int = 0
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    gpu_memory_bytes: int = 0
    devices: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The row as `pstrain status --json` prints it (a missing task: MISSING_FIELDS only)."""
        row = dataclasses.asdict(self)
        return {k: row[k] for k in MISSING_FIELDS} if self.state == "missing" else row

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> TaskRow:
        return cls(**row)

    def message(self) -> pb.TaskStatus:
        task_type, _, index = self.task.partition(":")
        return pb.TaskStatus(
            task=pb.TaskId(type=task_type, index=int(index)),
            state=self.state,
            host=self.host,
            hostname=self.hostname,
            address=self.address,
            pid=self.pid,
            heartbeat_age_s=self.heartbeat_age_s,
            step=self.step,
            steps_per_s=self.steps_per_s,
            gradients=self.gradients,
            resources=pb.Resources(
                cpu_percent=self.cpu_percent, rss_bytes=self.rss_bytes, gpu_memory_bytes=self.gpu_memory_bytes
            ),
            devices=self.devices,
            versions=pb.Versions(**self.versions),
            restarts=self.restarts,
            restarts_reset_at=self.restarts_reset_at,
        )

    @classmethod
    def from_message(cls, t: pb.TaskStatus) -> TaskRow:
        return cls(
            task=f"{t.task.type}:{t.task.index}",
            state=t.state,
            address=t.address,
            heartbeat_age_s=t.heartbeat_age_s,
            restarts=t.restarts,
            restarts_reset_at=t.restarts_reset_at,
            host=t.host,
            hostname=t.hostname,
            pid=t.pid,
            step=t.step,
            steps_per_s=t.steps_per_s,
            gradients=t.gradients,
            cpu_percent=t.resources.cpu_percent,
            rss_bytes=t.resources.rss_bytes,
            gpu_memory_bytes=t.resources.gpu_memory_bytes,
            devices=list(t.devices),
            versions={"pstrain": t.versions.pstrain, "tensorflow": t.versions.tensorflow, "python": t.versions.python},
        )
