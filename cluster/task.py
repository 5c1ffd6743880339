"""One task identity for every role: `TaskId("worker", 1)`, shown as `worker:1`, logged as `worker-1`."""

from __future__ import annotations

from typing import NamedTuple

TASK_TYPES = ("chief", "ps", "worker")  # the roles pstrain runs, in start-up and display order


class TaskId(NamedTuple):
    """A task of the cluster. A tuple, so `("worker", 1)` keys and TF's (type, index) pairs compare equal."""

    type: str  # "chief", "ps" or "worker"
    index: int

    @property
    def name(self) -> str:
        """How status tables, TF_CONFIG and messages name it: `worker:1`."""
        return f"{self.type}:{self.index}"

    @property
    def log_name(self) -> str:
        """File-safe: `logs/worker-1.log`."""
        return f"{self.type}-{self.index}"

    @property
    def is_chief(self) -> bool:
        return self.type == "chief"

    def __str__(self) -> str:
        return self.name

    def sort_key(self) -> tuple[int, int]:
        """Chief, then ps, then workers, each by index."""
        order = TASK_TYPES.index(self.type) if self.type in TASK_TYPES else len(TASK_TYPES)
        return order, self.index
