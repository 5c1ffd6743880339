"""The launcher's ClusterWatch over real child processes (no TF): a stop reaches the chief, hung and lost tasks."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from cluster.config import resolve
from cluster.control.registry import Registry
from cluster.launch import watch
from cluster.launch.launcher import expected_tasks
from cluster.launch.supervisor import Supervisor
from cluster.launch.watch import ClusterWatch
from cluster.policy import Restart
from cluster.rundir import RunDir
from cluster.stop import StopTrap
from cluster.task import TaskId
from cluster.task_setup import task_setup
from tests.helpers import wait_for_sigterm_handler

pytestmark = pytest.mark.cluster


BACK_OFF_S = 3600.0  # longer than any test runs: the run can only end inside it if the stop cuts it short


def test_a_stop_during_a_restart_back_off_reaches_the_chief_at_once(tmp_path, monkeypatch):
    """A worker crashed and its restart waits out a back-off; a SIGTERM sent once the back-off began (the
    event, not a fixed delay) is forwarded to the chief at once: the run ends inside an hour's back-off,
    and the worker is not restarted."""
    monkeypatch.setattr(watch, "restart_decision", lambda used, most: Restart(delay_s=BACK_OFF_S))
    cluster = resolve({"cluster": {"ps": 1, "workers": 1, "max_restarts": 5}}).cluster
    supervisor = Supervisor(tmp_path)
    backing_off, codes = threading.Event(), []

    def send_sigterm_once_backing_off() -> None:
        if backing_off.wait(timeout=60):
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        worker = supervisor.start(task_setup(cluster, "worker", 0), [sys.executable, "-c", "raise SystemExit(3)"])
        worker.process.wait()
        chief = supervisor.start(task_setup(cluster, "chief", 0), [sys.executable, "-c", "import time; time.sleep(600)"])
        with StopTrap() as stop:
            stop_wait = stop.wait

            def noting_the_back_off(seconds: float) -> bool:
                if seconds == BACK_OFF_S:
                    backing_off.set()
                return stop_wait(seconds)

            stop.wait = noting_the_back_off
            run_watch = ClusterWatch(
                supervisor, Registry(expected_tasks(cluster), {}, 10.0), cluster, 5.0, stop, RunDir(tmp_path)
            )
            runner = threading.Thread(target=lambda: codes.append(run_watch.run(chief)), daemon=True)
            threading.Thread(target=send_sigterm_once_backing_off, daemon=True).start()
            runner.start()
            runner.join(timeout=120)  # a bound on a hang only: the back-off it must cut short is an hour
    finally:
        supervisor.stop_all()
    assert backing_off.is_set(), "the crashed worker's restart never began its back-off"
    assert codes == [128 + signal.SIGTERM], "the run did not end inside the back-off: the stop waited for it"
    assert chief.process.returncode == -signal.SIGTERM, "the chief got the stop"
    assert [c.process.pid for c in supervisor.children] == [worker.process.pid, chief.process.pid], "no worker restarted"


SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
# A chief whose stop path checkpoints: it exits 128+15 on SIGTERM, as chief/finish.py has it after saving.
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
    worker = supervisor.start(task_setup(cluster, "worker", 0), SLEEPER) if start_worker else None
    address = cluster.workers[0]
    registry.register(TaskId("worker", 0), "127.0.0.1", address, worker.process.pid if worker else 4242, {}, [])
    clock.now = 11.0  # no heartbeat for 11 s
    chief = supervisor.start(task_setup(cluster, "chief", 0), chief_argv)
    return cluster, registry, supervisor, worker, chief, clock


def test_a_hung_local_worker_is_killed_and_restarted_and_the_run_goes_on(tmp_path, capsys):
    cluster, registry, supervisor, worker, chief, clock = silent_cluster(tmp_path, SLEEPER, start_worker=True)
    try:
        with StopTrap() as stop:
            supervision = ClusterWatch(supervisor, registry, cluster, 5.0, stop, RunDir(tmp_path))
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
    monkeypatch.setattr(watch, "CHIEF_STOP_GRACE_S", 0.5)
    cluster, registry, supervisor, _, chief, _ = silent_cluster(tmp_path, [*chief_argv, str(tmp_path)], start_worker=False)
    wait_for_sigterm_handler(chief.process.pid)  # the chief has set its signal handler
    try:
        with StopTrap() as stop:
            code = ClusterWatch(supervisor, registry, cluster, 5.0, stop, RunDir(tmp_path)).run(chief)
    finally:
        supervisor.stop_all()
    assert code == 1
    err = capsys.readouterr().err
    assert (
        f"pstrain: error: lost worker:0 at {cluster.workers[0]}: no heartbeat for 10s (network cut or hung task?); {outcome}"
        in err
    )
