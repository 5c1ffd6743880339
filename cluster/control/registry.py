"""The chief's view of the cluster: who registered, who is alive, who is missing. Pure logic.

The gRPC servicer (cluster/control/service.py) is a thin shell around this; a clock is injected so
heartbeat timeouts are testable without sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.control.status_row import TaskRow
from cluster.policy import restart_budget
from cluster.task import TaskId


@dataclass
class TaskRecord:
    host: str
    address: str
    pid: int
    devices: list[str]
    registered_at: float
    last_seen: float
    state: str = "registered"
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    gpu_memory_bytes: int = 0
    step: int = 0
    steps_per_s: float = 0.0
    gradients: int = 0
    versions: dict[str, str] = field(default_factory=dict)


@dataclass
class Registry:
    """Registration, heartbeats and status for the tasks of one cluster."""

    expected: dict[TaskId, str]  # task -> the address the cluster config gives it
    versions: dict[str, str]  # the chief's own versions; every task must match
    heartbeat_timeout: float
    total_steps: int = 0
    clock: Callable[[], float] = time.monotonic
    max_restarts: int = 0  # the restart budget, per task and window (cluster/policy.py `restart_budget`)
    restart_window: float = 600.0
    wall: Callable[[], float] = time.time  # the clock of restart times
    tasks: dict[TaskId, TaskRecord] = field(default_factory=dict)
    state: str = "waiting"
    stopping: bool = False  # the chief is asked to checkpoint and stop
    shutting_down: bool = False  # every task is asked to exit (after the chief is done)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    stop_reason: str = ""  # what asked the chief to stop (`request_stop`), for its log
    _last_step: tuple[float, int] | None = None
    _step_at: float | None = None  # when the chief's step last moved (clock)
    _restarts: dict[TaskId, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.expected = {TaskId(*k): address for k, address in self.expected.items()}

    def register(self, key: TaskId, host: str, address: str, pid: int, versions: dict[str, str], devices: list[str]):
        """Returns (accepted, reason)."""
        key = TaskId(*key)
        with self._lock:
            if key not in self.expected:
                count = sum(1 for k in self.expected if k.type == key.type)
                return False, f"{key.name} is not in this cluster ({count} {key.type} tasks); check its TF_CONFIG"
            skew = [f"{k} {versions.get(k, '?')} (chief has {v})" for k, v in self.versions.items() if versions.get(k) != v]
            if skew:
                return False, f"{key.name} runs {', '.join(skew)}; install the chief's versions on {host}"
            current = self.tasks.get(key)
            restarted = current is not None and (current.host, current.address) == (host, address)
            if current and (current.host, current.pid) != (host, pid) and not restarted and not self._lost(current):
                return False, (
                    f"{key.name} is already registered by pid {current.pid} on {current.host}; "
                    "each slot runs once (stop the other task or fix the task index)"
                )
            now = self.clock()
            self.tasks[key] = TaskRecord(host, address, pid, list(devices), now, now, versions=dict(versions))
            return True, ""

    def heartbeat(self, key: TaskId, state: str, resources: dict[str, float], step: int, gradients: dict[int, int]) -> bool:
        """Record a heartbeat; returns True when the task should stop."""
        key = TaskId(*key)
        with self._lock:
            record = self.tasks.get(key)
            stop = self.stopping if key.is_chief else self.shutting_down
            if record is None:
                return stop
            now = self.clock()
            record.last_seen, record.state = now, state
            record.cpu_percent = resources.get("cpu_percent", 0.0)
            record.rss_bytes = int(resources.get("rss_bytes", 0))
            record.gpu_memory_bytes = int(resources.get("gpu_memory_bytes", 0))
            if key.is_chief:
                if self._last_step and now > self._last_step[0] and step >= self._last_step[1]:
                    record.steps_per_s = (step - self._last_step[1]) / (now - self._last_step[0])
                self._last_step = (now, step)
                if step != record.step or self._step_at is None:
                    self._step_at = now
                record.step = step
                if state == "training":
                    self.state = "training"
                for index, count in gradients.items():
                    worker = self.tasks.get(TaskId("worker", index))
                    if worker:
                        worker.gradients = count
            return stop

    def knows(self, key: TaskId) -> bool:
        with self._lock:
            return TaskId(*key) in self.tasks

    def request_stop(self, reason: str = "") -> None:
        """Ask the chief to checkpoint and stop (`reason`: what asked, e.g. "pstrain stop from HOST");
        the servers stay up until it has."""
        with self._lock:
            self.stopping = True
            self.stop_reason = self.stop_reason or reason
            self.state = "stopping"

    def shutdown(self) -> None:
        """Ask every task to exit."""
        with self._lock:
            self.stopping = self.shutting_down = True
            self.state = "stopping"

    def _lost(self, record: TaskRecord) -> bool:
        return self.clock() - record.last_seen > self.heartbeat_timeout

    def lost(self) -> list[tuple[TaskId, TaskRecord]]:
        """(task, record) of every registered task silent past the heartbeat timeout."""
        with self._lock:
            return [(k, r) for k, r in sorted(self.tasks.items()) if self._lost(r)]

    def forget(self, key: TaskId) -> None:
        """A task is being restarted: it is missing until it registers again."""
        with self._lock:
            self.tasks.pop(key, None)

    def note_restarts(self, key: TaskId, times: tuple[float, ...]) -> None:
        """When the launcher restarted a task (wall clock): its restart budget in `status`."""
        with self._lock:
            self._restarts[TaskId(*key)] = tuple(times)

    def _budget_row(self, key: TaskId) -> dict:
        budget = restart_budget(self._restarts.get(key, ()), self.wall(), self.max_restarts, self.restart_window)
        return {"restarts": budget.used, "restarts_reset_at": budget.resets_at or 0.0}

    def missing(self) -> list[tuple[TaskId, str]]:
        """(task, expected address) of every task that has not registered."""
        with self._lock:
            return [(k, a) for k, a in sorted(self.expected.items()) if k not in self.tasks]

    def status(self) -> dict:
        """The cluster as a plain dict (what `pstrain status --json` prints)."""
        with self._lock:
            now = self.clock()
            chief = self.tasks.get(TaskId("chief", 0))
            rows = []
            for key in sorted(self.expected, key=TaskId.sort_key):
                record = self.tasks.get(key)
                budget = self._budget_row(key)
                if record is None:
                    row = TaskRow(key.name, "missing", self.expected[key], -1.0, **budget)
                else:
                    row = TaskRow(
                        task=key.name,
                        state="lost" if self._lost(record) else record.state,
                        address=record.address,
                        heartbeat_age_s=round(now - record.last_seen, 3),
                        **budget,
                        host=record.address.rpartition(":")[0].strip("[]"),
                        hostname=record.host,
                        pid=record.pid,
                        step=chief.step if chief else 0,
                        steps_per_s=round(chief.steps_per_s, 3) if chief else 0.0,
                        gradients=record.gradients,
                        cpu_percent=record.cpu_percent,
                        rss_bytes=record.rss_bytes,
                        gpu_memory_bytes=record.gpu_memory_bytes,
                        devices=list(record.devices),
                        versions=dict(record.versions),
                    )
                rows.append(row.as_dict())
            return {
                "state": self.state,
                "step": chief.step if chief else 0,
                "step_age_s": round(now - self._step_at, 3) if chief and self._step_at is not None else -1.0,
                "total_steps": self.total_steps,
                "max_restarts": self.max_restarts,
                "restart_window_s": self.restart_window,
                "tasks": rows,
            }
