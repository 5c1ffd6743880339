"""The launcher's Supervision over real child processes (no TF): how fast a stop reaches the chief."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from cluster.config import resolve
from cluster.control.registry import Registry
from cluster.launch.launcher import Supervision, expected_tasks
from cluster.launch.supervisor import Supervisor
from cluster.plan import plan_task
from cluster.stop import StopTrap


def test_a_stop_during_a_restart_back_off_reaches_the_chief_at_once(tmp_path):
    """A worker has crashed for the 4th time (back-off 8 s); SIGTERM half a second into the back-off
    is forwarded to the chief at once, and the worker is not restarted."""
    cluster = resolve({"cluster": {"ps": 1, "workers": 1, "max_restarts": 5}}).cluster
    supervisor = Supervisor(tmp_path)
    signalled: list[float] = []

    def send_sigterm() -> None:
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Timer(0.5, send_sigterm)
    try:
        worker = supervisor.start(plan_task(cluster, "worker", 0), [sys.executable, "-c", "raise SystemExit(3)"])
        worker.process.wait()
        worker.restarts = 3
        chief = supervisor.start(plan_task(cluster, "chief", 0), [sys.executable, "-c", "import time; time.sleep(60)"])
        with StopTrap() as stop:
            supervision = Supervision(supervisor, Registry(expected_tasks(cluster), {}, 10.0), cluster, 5.0, stop)
            timer.start()
            code = supervision.run(chief)
            returned = time.monotonic()
    finally:
        timer.cancel()
        supervisor.stop_all()
    assert code == 128 + signal.SIGTERM and chief.process.returncode == -signal.SIGTERM
    assert returned - signalled[0] < 2.0, f"the stop took {returned - signalled[0]:.2f}s to reach the chief (back-off 8 s)"
    assert [c.process.pid for c in supervisor.children] == [worker.process.pid, chief.process.pid], "no worker restarted"
