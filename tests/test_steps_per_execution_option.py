"""`pytest --steps-per-execution K` (tests/conftest.py): the K every launch and train of the session runs at."""

from __future__ import annotations

import pytest

from tests import helpers

pytestmark = pytest.mark.pure


def test_launch_and_train_get_the_sessions_k_unless_they_set_their_own(monkeypatch):
    monkeypatch.setattr(helpers, "STEPS_PER_EXECUTION", 1)
    assert helpers.with_block_length(["launch", "--steps", "20"]) == ["launch", "--steps-per-execution", "1", "--steps", "20"]
    assert helpers.with_block_length(["train", "--standalone"]) == ["train", "--steps-per-execution", "1", "--standalone"]
    own = ["launch", "--steps-per-execution", "4"]
    assert helpers.with_block_length(own) == own
    assert helpers.with_block_length(["plan", "--job", "j"]) == ["plan", "--job", "j"]  # not a training run
    assert helpers.with_block_length(["stop", "--chief", "h:1"]) == ["stop", "--chief", "h:1"]


def test_without_the_option_every_run_keeps_its_config_k(monkeypatch):
    monkeypatch.setattr(helpers, "STEPS_PER_EXECUTION", None)
    assert helpers.with_block_length(["launch", "--steps", "20"]) == ["launch", "--steps", "20"]
