"""The benchmark's one timing definition (tests/benchmarks/window.py), the same for every peer."""

from __future__ import annotations

import pytest

from tests.benchmarks.bench import last_error, peer_rows
from tests.benchmarks.fair import chunks
from tests.benchmarks.rounds import PeerFailed, run_rounds
from tests.benchmarks.window import block_ends, measure, running_max

pytestmark = pytest.mark.pure


def test_the_window_runs_from_the_runs_half_to_its_end_and_start_up_ends_at_the_first_applied_step():
    samples = [(0, 9.0), (1, 10.0), (17, 11.0), (33, 12.5), (40, 13.2)]  # one block of 1, then blocks of 16, 16, 7
    result = measure(samples, steps=40, t_launch=4.0)
    assert result["startup_s"] == pytest.approx(6.0)  # launch to step 1, not to the first sample
    assert result["window"] == [33, 40] and result["step_s"] == pytest.approx(0.7 / 7)


def test_a_short_run_falls_back_to_its_first_applied_step_and_a_run_without_progress_is_refused():
    assert measure([(1, 1.0), (5, 2.0)], steps=5, t_launch=0.0)["step_s"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="two samples"):
        measure([(1, 1.0)], steps=5, t_launch=0.0)
    with pytest.raises(ValueError, match="no step applied after the first"):
        measure([(1, 1.0), (1, 2.0)], steps=5, t_launch=0.0)


def test_samples_of_several_reporters_merge_as_the_most_steps_seen_by_each_time():
    assert running_max([(3, 2.0), (1, 1.0), (2, 3.0), (5, 4.0)]) == [(1, 1.0), (3, 2.0), (3, 3.0), (5, 4.0)]


def test_pstrain_samples_are_its_blocks_ends_so_the_gaps_between_blocks_count():
    records = [{"event": "start", "time": 0.5}, {"step": 0, "seconds": 0.3, "time": 1.0}]
    records += [{"step": s, "seconds": 0.01, "time": 2.0 + s / 1000} for s in range(1, 5)]  # a block of 4
    records += [{"step": s, "seconds": 0.02, "time": 3.0 + s / 1000} for s in range(5, 9)]  # the next
    assert block_ends(records) == [(1, 1.0), (5, 2.004), (9, 3.008)]


def test_dispatches_cover_the_run():
    assert chunks(40, 16) == [1, 16, 16, 7] and chunks(33, 16) == [1, 16, 16] and chunks(1, 16) == [1]


def test_a_peer_that_fails_is_reported_with_why_and_not_run_again_while_the_others_go_on():
    tried: list[str] = []

    def run_one(peer: str, k: int | None) -> dict:
        tried.append(peer)
        if peer == "mwms":
            raise PeerFailed("mwms printed no result: InternalError: Tensor Size Mismatch")
        return {"step_s": 0.01 if peer == "pstrain" else 0.02, "startup_s": 4.0}

    rounds = run_rounds(run_one, ["pstrain", "tf1", "mwms"], "10m", repeats=3, sweep=(), warmup_rounds=0)
    runs, failed = rounds["runs"], rounds["failed"]
    assert tried.count("mwms") == 1 and tried.count("pstrain") == 3 and tried.count("tf1") == 3
    assert failed == {"mwms": "mwms printed no result: InternalError: Tensor Size Mismatch"} and runs["mwms"] == []
    rows = peer_rows(runs, 128, failed)
    why = "did not run: InternalError: Tensor Size Mismatch"
    assert any(row.startswith("| MultiWorkerMirrored") and why in row for row in rows), rows
    assert any(row.startswith("| TF1") and "| 2.00× |" in row for row in rows), rows


def test_the_error_named_is_the_last_status_line_of_a_process():
    text = "I0000 00:00 some InternalError in a log line\nTraceback\ntensorflow.errors_impl.InternalError: Tensor Size Mismatch\n"
    assert last_error(text) == "tensorflow.errors_impl.InternalError: Tensor Size Mismatch"
    assert last_error("all well\n") == ""
    status = "tensorflow.python.framework.errors_impl.InternalError: {{function_node __wrapped__X_device_/job:worker}} Mismatch"
    assert last_error(status) == "InternalError: Mismatch"
