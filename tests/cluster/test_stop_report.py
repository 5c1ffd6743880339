"""Pure: what the console says when a run stops and how long a run took (no processes)."""

from __future__ import annotations

import signal

import pytest

from cluster.control.service import peer_host
from cluster.run_times import RunTimes, done_fields, done_phrase, run_times
from cluster.stop import StopTrap
from cluster.stop_report import StopOutcome, stop_outcome

pytestmark = pytest.mark.pure


def test_a_first_run_counts_from_its_launch():
    times = run_times([{"event": "launch", "time": 100.0}, {"event": "chief", "time": 101.0}], now=103.5)
    assert times == RunTimes(total_s=3.5, launch_s=3.5, restarts=0)
    assert done_phrase(times) == "done in 3.5s"
    assert done_fields(times) == {"wall_seconds": 3.5, "launch_seconds": 3.5, "restarts": 0}


def test_a_chief_restart_and_a_resume_count_from_the_first_launch():
    records = [
        {"event": "launch", "time": 100.0},
        {"event": "chief", "time": 101.0},
        {"event": "chief", "time": 110.0},  # restarted by the launcher after a lost ps
        {"event": "launch", "time": 200.0},  # the same command again
        {"event": "chief", "time": 201.0},
    ]
    times = run_times(records, now=226.7)
    assert times == RunTimes(total_s=pytest.approx(126.7), launch_s=pytest.approx(26.7), restarts=2)
    assert done_phrase(times) == "done in 126.7s since the first launch (this launch 26.7s, 2 restarts)"


def test_a_chief_without_a_recorded_launch_and_a_run_without_records():
    assert run_times([{"event": "chief", "time": 50.0}], now=60.0) == RunTimes(10.0, 10.0, 0)
    assert run_times([], now=60.0) == RunTimes(0.0, 0.0, 0)
    assert run_times([{"event": "chief", "time": "garbled"}], now=60.0).total_s == 0.0


@pytest.mark.parametrize(
    "cause, commanded, checkpoint, how, expected",
    [
        (
            "pstrain stop from host-a",
            True,
            20,
            "saved",
            StopOutcome(
                "pstrain: stopped by pstrain stop from host-a after step 20; checkpoint saved, "
                "run the same command to resume from checkpoint step 20",
                0,
            ),
        ),
        (
            "SIGTERM",
            False,
            20,
            "saved",
            StopOutcome(
                "pstrain: stopped by SIGTERM after step 20; checkpoint saved, "
                "run the same command to resume from checkpoint step 20",
                143,
            ),
        ),
        (
            "Ctrl-C",
            False,
            None,
            "start-up",
            StopOutcome(
                "pstrain: stopped by Ctrl-C during start-up, before any step ran; "
                "run the same command to start (no checkpoint yet)",
                143,
            ),
        ),
        (
            "pstrain stop from host-a",
            True,
            75,
            "killed after 8s",
            StopOutcome(
                "pstrain: stopped by pstrain stop from host-a; the chief could not checkpoint (killed after 8s); "
                "run the same command to resume from checkpoint step 75",
                143,
            ),
        ),
    ],
)
def test_stop_outcome(cause, commanded, checkpoint, how, expected):
    outcome = stop_outcome(cause, commanded, 143, checkpoint, how)
    assert outcome == expected
    assert "error" not in outcome.line


def test_stop_trap_names_the_cause_and_whether_a_command_asked():
    with StopTrap() as stop:
        stop.request(signal.SIGINT)
        stop.request(signal.SIGTERM, cause="pstrain stop from x")  # the first request wins
        assert (stop.cause, stop.commanded, stop.exit_code) == ("Ctrl-C", False, 130)
    with StopTrap() as stop:
        stop.request(signal.SIGTERM, cause="pstrain stop from host-a")
        assert (stop.cause, stop.commanded, stop.exit_code) == ("pstrain stop from host-a", True, 143)


def test_peer_host():
    assert peer_host("ipv4:127.0.0.1:5432") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:5432") == "::1"
