"""The Ray actor that hosts one pstrain task on the node Ray placed it on: it reports the node's
address, a free port and its GPUs, then starts, signals and reaps the task's process there with
the launcher's own Supervisor (the task dies with the actor: cluster/taskenv.py's parent pid).

A plain class: cluster/launch/ray_engine.py wraps it with `ray.remote`, so importing this module
needs no Ray. Every method returns at once (no call blocks the actor for long)."""

from __future__ import annotations

import os
from pathlib import Path

from cluster.launch.ports import free_port
from cluster.launch.supervisor import Child, Supervisor
from cluster.task_setup import TaskSetup

RAY_WORKER_ENV = ("OMP_NUM_THREADS",)  # what Ray sets in an actor's process for itself, not for its tasks


class TaskHost:
    def __init__(self, log_dir: str, cwd: str, launcher_env: dict[str, str]):
        self.supervisor = Supervisor(Path(log_dir))
        self.child: Child | None = None
        if os.path.isdir(cwd):  # jobs in the launcher's working directory import, as under `pstrain launch`
            os.chdir(cwd)
        # The task's environment as under `pstrain launch`: the launcher's settings, without the thread
        # limit Ray sets for its own workers.
        for name in RAY_WORKER_ENV:
            os.environ.pop(name, None)
        os.environ.update(launcher_env)

    def where(self) -> tuple[str, int, tuple[int, ...]]:
        """(this node's address as Ray knows it, a port free on it now, the GPU ids Ray assigned)."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, free_port(host), tuple(int(g) for g in ray.get_gpu_ids())

    def sees(self, path: str, content: str) -> bool:
        """Whether this node reads `content` at `path`: the run dir is shared with the launcher."""
        try:
            return Path(path).read_text() == content
        except OSError:
            return False

    def start(self, setup: TaskSetup, argv: list[str], extra_env: dict[str, str]) -> int:
        """Start the task (again, after an exit: same setup, its log continues); returns its pid."""
        if self.child is not None:
            self.supervisor.reap(self.child)
            self.supervisor.children.remove(self.child)
        self.supervisor.log_dir.mkdir(parents=True, exist_ok=True)
        self.child = self.supervisor.start(setup, argv, extra_env=extra_env)
        return self.child.process.pid

    def poll(self) -> int | None:
        """The task's return code (Popen's: -N after signal N), or None while it runs."""
        return None if self.child is None else self.child.process.poll()

    def signal(self, signum: int) -> None:
        if self.child is not None and self.child.process.poll() is None:
            try:
                self.child.process.send_signal(signum)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace; the task is reaped."""
        self.supervisor.stop_all()
