"""`pytest --steps-per-execution K` and `pytest --dense MODE` (tests/conftest.py): the K and dense mode every
launch and train of the session runs at, and the skip of a run the hybrid refuses."""

from __future__ import annotations

import pytest

from tests import helpers

pytestmark = pytest.mark.pure

REFUSED = 'pstrain: error: train.dense = "allreduce" does not take backup workers yet: set ...'


def test_launch_and_train_get_the_sessions_k_unless_they_set_their_own(monkeypatch):
    monkeypatch.setattr(helpers, "STEPS_PER_EXECUTION", 1)
    assert helpers.with_session_flags(["launch", "--steps", "20"]) == ["launch", "--steps-per-execution", "1", "--steps", "20"]
    assert helpers.with_session_flags(["train", "--standalone"]) == ["train", "--steps-per-execution", "1", "--standalone"]
    own = ["launch", "--steps-per-execution", "4"]
    assert helpers.with_session_flags(own) == own
    assert helpers.with_session_flags(["plan", "--job", "j"]) == ["plan", "--job", "j"]  # not a training run
    assert helpers.with_session_flags(["stop", "--chief", "h:1"]) == ["stop", "--chief", "h:1"]


def test_launch_and_train_get_the_sessions_dense_mode_unless_they_set_their_own(monkeypatch):
    monkeypatch.setattr(helpers, "STEPS_PER_EXECUTION", 1)
    monkeypatch.setattr(helpers, "DENSE", "allreduce")
    both = ["launch", "--steps-per-execution", "1", "--dense", "allreduce", "--steps", "20"]
    assert helpers.with_session_flags(["launch", "--steps", "20"]) == both
    own = ["launch", "--dense", "ps"]
    assert helpers.with_session_flags(own) == ["launch", "--steps-per-execution", "1", "--dense", "ps"]
    assert helpers.with_session_flags(["status", "--run-dir", "r"]) == ["status", "--run-dir", "r"]


def test_without_the_options_every_run_keeps_its_config_k_and_mode(monkeypatch):
    monkeypatch.setattr(helpers, "STEPS_PER_EXECUTION", None)
    monkeypatch.setattr(helpers, "DENSE", None)
    assert helpers.with_session_flags(["launch", "--steps", "20"]) == ["launch", "--steps", "20"]


def test_a_run_the_session_switched_to_the_hybrid_and_that_it_refused_skips_naming_why(monkeypatch):
    monkeypatch.setattr(helpers, "DENSE", "allreduce")
    refused = helpers.Result(2, f"pstrain: launching\n{REFUSED}\n")
    with pytest.raises(pytest.skip.Exception, match="the hybrid refuses this run: train.dense .* backup workers"):
        helpers.skip_if_the_session_hybrid_refused(["launch", "--steps", "5"], refused)


@pytest.mark.parametrize(
    ("dense", "args", "result"),
    [
        ("allreduce", ["launch", "--dense", "allreduce"], helpers.Result(2, REFUSED)),  # the test's own refusal
        ("allreduce", ["launch"], helpers.Result(2, "pstrain: error: train.steps: expected ...")),  # another error
        ("allreduce", ["launch"], helpers.Result(1, REFUSED)),  # not the launch's refusal exit
        (None, ["launch"], helpers.Result(2, REFUSED)),  # the session left the mode alone
    ],
    ids=["tests-own-mode", "other-error", "other-exit", "no-session-mode"],
)
def test_every_other_run_is_left_to_the_test(monkeypatch, dense, args, result):
    monkeypatch.setattr(helpers, "DENSE", dense)
    helpers.skip_if_the_session_hybrid_refused(args, result)  # returns: the test goes on to its own assertions
