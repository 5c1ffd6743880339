"""The launcher's Supervision over real child processes (no TF): how fast a stop reaches the chief."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from cluster.config import resolve
from cluster.control.registry import Registry
from cluster.launch import launcher
from cluster.launch.launcher import Supervision, expected_tasks
from cluster.launch.supervisor import Supervisor
from cluster.plan import plan_task
from cluster.stop import StopTrap
from cluster.task import TaskId
from tests.helpers import wait_for_sigterm_handler

pytestmark = pytest.mark.cluster


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
    # Measured against the 8 s back-off it must cut short (SIGTERM 0.5 s into it), not a tight bound: 2 busy cores.
    assert returned - signalled[0] < 6.0, f"the stop took {returned - signalled[0]:.2f}s to reach the chief (back-off 8 s)"
    assert [c.process.pid for c in supervisor.children] == [worker.process.pid, chief.process.pid], "no worker restarted"


SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
# A chief whose stop path checkpoints: it exits 128+15 on SIGTERM, as chief/trainer.py does after saving.
CHECKPOINTING_CHIEF = [
    sys.executable,
    "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); time.sleep(120)",
]
# A chief whose checkpoint (of a large model) takes longer than the grace: its write grows a file every 0.2 s
# for 1.6 s, then completes checkpoint 80 and exits 143. The grace counts from the write's last progress.
SLOW_WRITER_CHIEF = [
    sys.executable,
    "-c",
    """
import os, signal, sys, time
def save(*_):
    d = os.path.join(sys.argv[1], "checkpoints")
    os.makedirs(f"{d}/ckpt-80_temp")
    for _ in range(8):
        with open(f"{d}/ckpt-80_temp/part-0", "ab") as f:
            f.write(b"x" * 1000)
        time.sleep(0.2)
    os.rename(f"{d}/ckpt-80_temp/part-0", f"{d}/ckpt-80.data-00000-of-00001")
    os.rmdir(f"{d}/ckpt-80_temp")
    open(f"{d}/ckpt-80.index", "w").close()
    with open(f"{d}/checkpoint", "w") as f:
        f.write('model_checkpoint_path: "ckpt-80"\\n')
    sys.exit(143)
signal.signal(signal.SIGTERM, save)
time.sleep(120)
""",
]
# A chief stuck where a stop cannot reach it (SIGTERM ignored): the launcher kills it after the grace period.
STUCK_CHIEF = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def silent_cluster(tmp_path, chief_argv, start_worker: bool):
    """A cluster of one ps and one worker whose worker registered and then went silent past the heartbeat
    timeout (a clock moved on); the worker is a process started here, or one on another machine."""
    cluster = resolve({"cluster": {"ps": 1, "workers": 1, "max_restarts": 2, "heartbeat_timeout": 10}}).cluster
    clock = Clock()
    registry = Registry(expected_tasks(cluster), {}, cluster.heartbeat_timeout, clock=clock)
    supervisor = Supervisor(tmp_path / "logs")
    (tmp_path / "logs").mkdir()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "checkpoint").write_text(
        'model_checkpoint_path: "ckpt-75"\nall_model_checkpoint_paths: "ckpt-75"\n'
    )
    worker = supervisor.start(plan_task(cluster, "worker", 0), SLEEPER) if start_worker else None
    address = cluster.workers[0]
    registry.register(TaskId("worker", 0), "127.0.0.1", address, worker.process.pid if worker else 4242, {}, [])
    clock.now = 11.0  # no heartbeat for 11 s
    chief = supervisor.start(plan_task(cluster, "chief", 0), chief_argv)
    return cluster, registry, supervisor, worker, chief, clock


def test_a_hung_local_worker_is_killed_and_restarted_and_the_run_goes_on(tmp_path, capsys):
    cluster, registry, supervisor, worker, chief, clock = silent_cluster(tmp_path, SLEEPER, start_worker=True)
    try:
        with StopTrap() as stop:
            supervision = Supervision(supervisor, registry, cluster, 5.0, stop, tmp_path)
            supervision._check_silent()
            assert worker.process.wait(timeout=10) == -signal.SIGKILL, "the hung worker was killed"
            supervision._restart_dead_servers()
            assert not supervision.failure, "the run goes on"
            restarted = next(c for c in supervisor.children if c.task == worker.task)
            assert restarted.restarts == 1 and restarted.process.poll() is None
            assert TaskId("worker", 0) not in registry.tasks, "missing until it registers again"
    finally:
        supervisor.stop_all()
    err = capsys.readouterr().err
    assert (
        f"pstrain: warning: worker-0 sent no heartbeat for 10s (hung?) and was killed; restarting (1 of 2) in 1s; "
        f"its log: {tmp_path / 'logs' / 'worker-0.log'}"
    ) in err
    assert "error" not in err


@pytest.mark.parametrize(
    "chief_argv, outcome",
    [
        (CHECKPOINTING_CHIEF, "stopped with a checkpoint; run the same command again to resume from checkpoint step 75"),
        (
            STUCK_CHIEF,
            "the chief could not checkpoint (killed after 0.5s without checkpoint progress); "
            "run the same command again to resume from checkpoint step 75",
        ),
        (SLOW_WRITER_CHIEF, "stopped with a checkpoint; run the same command again to resume from checkpoint step 80"),
    ],
    ids=["chief-checkpoints", "chief-stuck", "chief-writes-longer-than-the-grace"],
)
def test_a_task_lost_on_another_machine_ends_the_run_saying_what_became_of_the_checkpoint(
    tmp_path, capsys, monkeypatch, chief_argv, outcome
):
    monkeypatch.setattr(launcher, "CHIEF_STOP_GRACE_S", 0.5)
    cluster, registry, supervisor, _, chief, _ = silent_cluster(tmp_path, [*chief_argv, str(tmp_path)], start_worker=False)
    wait_for_sigterm_handler(chief.process.pid)  # the chief has set its signal handler
    try:
        with StopTrap() as stop:
            code = Supervision(supervisor, registry, cluster, 5.0, stop, tmp_path).run(chief)
    finally:
        supervisor.stop_all()
    assert code == 1
    err = capsys.readouterr().err
    assert (
        f"pstrain: error: lost worker:0 at {cluster.workers[0]}: no heartbeat for 10s (network cut or hung task?); {outcome}"
        in err
    )
