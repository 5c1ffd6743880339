"""Pure decisions and identities, tested without processes: restart policy, stop trap, task names."""

from __future__ import annotations

import os
import signal
import time

import pytest

from cluster.control.registry import Registry
from cluster.control.status_table import format_status
from cluster.errors import EXIT_RESTARTABLE, ConfigError, PstrainError, RestartableError, TrainingError, returncode_exit_code
from cluster.policy import (
    CannotReform,
    EndRun,
    Finish,
    GiveUp,
    Kill,
    ReformWorkers,
    Restart,
    RestartBudget,
    budget_phrase,
    chief_decision,
    collectives_decision,
    restart_budget,
    restart_decision,
    silent_task_decision,
)
from cluster.rundir import checkpoint_step
from cluster.stop import StopTrap
from cluster.task import TaskId

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    "restarts, max_restarts, expected",
    [
        (0, 3, Restart(1.0)),
        (1, 3, Restart(2.0)),
        (2, 3, Restart(4.0)),
        (3, 3, GiveUp("4 times; giving up")),
        (0, 0, GiveUp("1 times; giving up")),
        (5, 10, Restart(8.0)),  # back-off is capped
    ],
)
def test_restart_decision(restarts, max_restarts, expected):
    assert restart_decision(restarts, max_restarts) == expected


@pytest.mark.parametrize(
    "code, restarts, stop_code, expected",
    [
        (0, 0, None, Finish(0)),
        (1, 0, None, Finish(1)),
        (EXIT_RESTARTABLE, 0, None, Restart(0.0)),  # a ps was lost: restart the chief, it resumes
        (EXIT_RESTARTABLE, 3, None, Finish(EXIT_RESTARTABLE)),  # out of restarts
        (130, 0, 130, Finish(130)),  # Ctrl-C: the chief checkpointed and stopped
        (0, 0, 143, Finish(0)),  # the chief finished before the stop reached it
        (EXIT_RESTARTABLE, 0, 143, Finish(143)),  # a stop request is never turned into a restart
    ],
)
def test_chief_decision(code, restarts, stop_code, expected):
    assert chief_decision(code, restarts, max_restarts=3, stop_code=stop_code) == expected


def test_stop_trap_records_the_first_signal_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with StopTrap() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.signum == signal.SIGTERM
        assert stop.exit_code == 143 and stop.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_stop_trap_programmatic_request():
    with StopTrap() as stop:
        stop.request()
        assert stop.exit_code == 128 + signal.SIGTERM


def test_task_identity():
    task = TaskId("worker", 1)
    assert (task.name, task.log_name, str(task)) == ("worker:1", "worker-1", "worker:1")
    assert task == ("worker", 1) and {("worker", 1): "x"}[task] == "x"
    ordered = sorted([TaskId("worker", 0), TaskId("ps", 1), TaskId("chief", 0), TaskId("ps", 0)], key=TaskId.sort_key)
    assert [t.name for t in ordered] == ["chief:0", "ps:0", "ps:1", "worker:0"]


def test_error_exit_codes():
    assert [e.exit_code for e in (ConfigError("x"), TrainingError("x"), RestartableError("x"), PstrainError("x"))] == [
        2,
        1,
        75,
        1,
    ]
    assert returncode_exit_code(-9) == 137 and returncode_exit_code(3) == 3


@pytest.mark.parametrize(
    "started_here, running, expected",
    [
        (True, True, Kill()),  # hung here: killed, then restarted like a dead task
        (True, False, None),  # already dead here: the restart policy's
        (False, False, EndRun()),  # on another machine: maybe only cut off, cannot be killed from here
    ],
)
def test_silent_task_decision(started_here, running, expected):
    assert silent_task_decision(started_here, running) == expected


@pytest.mark.parametrize(
    "text, step",
    [
        ('model_checkpoint_path: "ckpt-75"\nall_model_checkpoint_paths: "ckpt-50"\n', 75),
        ('model_checkpoint_path: "/runs/x/checkpoints/ckpt-1200"\n', 1200),
        ("", None),
    ],
)
def test_checkpoint_step(text, step):
    assert checkpoint_step(text) == step


def test_restart_budget_counts_the_restarts_of_the_last_window():
    """Three restarts in 15 s use the budget up; ten minutes after the last one it is whole again."""
    times = [1000.0, 1005.0, 1015.0]
    spent = restart_budget(times, now=1016.0, max_restarts=3, window_s=600.0)
    assert spent == RestartBudget(used=3, max_restarts=3, window_s=600.0, resets_at=1615.0)
    assert isinstance(restart_decision(spent.used, 3), GiveUp)
    partly = restart_budget(times, now=1604.0, max_restarts=3, window_s=600.0)  # the first one left the window
    assert partly.used == 2 and restart_decision(partly.used, 3) == Restart(4.0)
    whole = restart_budget(times, now=1615.0, max_restarts=3, window_s=600.0)
    assert whole == RestartBudget(0, 3, 600.0, None) and restart_decision(whole.used, 3) == Restart(1.0)
    assert chief_decision(EXIT_RESTARTABLE, whole.used, 3, None) == Restart(0.0)


def test_budget_phrase_says_when_the_count_resets():
    resets = time.mktime((2026, 12, 4, 22, 31, 5, 0, 0, -1))
    assert budget_phrase(RestartBudget(1, 3, 600.0, resets)) == "the count resets at 22:31:05 (3 per 10 min)"
    assert budget_phrase(RestartBudget(0, 3, 30.0, None)) == "no restart counts now (3 per 30s)"


def test_status_shows_each_tasks_restarts_and_when_they_reset():
    now = [1000.0]
    registry = Registry({TaskId("worker", 0): "127.0.0.1:1"}, {}, 10.0, max_restarts=3, restart_window=600.0, wall=lambda: now[0])
    registry.note_restarts(TaskId("worker", 0), (990.0, 995.0))
    status = registry.status()
    assert (status["max_restarts"], status["restart_window_s"]) == (3, 600.0)
    assert status["tasks"][0]["restarts"] == 2 and status["tasks"][0]["restarts_reset_at"] == 1595.0
    table = format_status(status)
    assert "restarts: at most 3 per task in 10 min" in table.splitlines()[0]
    assert table.startswith("cluster ") and ", step 0/0" not in table  # total 0: a run by epochs, its steps unknown here
    assert f"2 of 3 until {time.strftime('%H:%M:%S', time.localtime(1595.0))}" in table
    now[0] = 1600.0
    assert registry.status()["tasks"][0]["restarts"] == 0


def test_a_lost_worker_restarts_every_worker_only_under_the_hybrid_step():
    """ "ps": ClusterCoordinator rides out a lost worker; "allreduce": every worker restarts, then the chief,
    where this launcher started them all, else the run ends saying how many run elsewhere."""
    assert collectives_decision("ps", 2, 2) is None and collectives_decision("ps", 4, 1) is None
    assert collectives_decision("allreduce", 2, 2) == ReformWorkers()
    ended = collectives_decision("allreduce", 4, 2)
    assert isinstance(ended, CannotReform) and "2 of the 4 workers run on other machines" in ended.reason
    assert 'train.dense = "allreduce"' in ended.reason
