"""The data behind `pstrain plot`, from plain records (no run needed)."""

from __future__ import annotations

import json

import pytest

from chief.plots import gradient_series, load_records, loss_series, phase_series, throughput_series, y_limit
from cluster.errors import ConfigError
from cluster.rundir import RunDir

pytestmark = pytest.mark.pure


def record(step, seconds=0.1, workers=(0, 1), timing=None):
    out = {"step": step, "loss": 1.0 / (step + 1), "aggregated": 2, "workers": list(workers), "seconds": seconds}
    if timing is not None:
        out["timing"] = timing
    return out


def test_load_records_turns_the_done_line_into_a_final_eval_point(tmp_path):
    lines = [record(0), record(1), {"event": "eval", "step": 2, "loss": 0.7}, {"event": "done", "steps": 2, "eval_loss": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 2, "lo')
    steps, evals = load_records(RunDir(tmp_path))
    assert [r["step"] for r in steps] == [0, 1]  # the line cut short is skipped
    assert loss_series(steps, evals) == {"train": ([0, 1], [1.0, 0.5]), "eval": ([2, 2], [0.7, 0.5])}


def test_load_records_says_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match="metrics.jsonl not found"):
        load_records(RunDir(tmp_path))
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no step records"):
        load_records(RunDir(tmp_path))


def test_phases_stack_to_the_step_time():
    timing = {"dispatch": 0.01, "steps": 0.08}
    x, stacks = phase_series([record(0, 0.1, timing=timing), record(1, 0.08, timing=timing)])
    assert x == [0, 1] and list(stacks) == ["dispatch", "steps", "other"]
    assert [round(sum(s[i] for s in stacks.values()), 6) for i in range(2)] == [100.0, 90.0]  # ms; never below the phases
    assert round(stacks["other"][0], 6) == 10.0 and stacks["other"][1] == 0.0


def test_standalone_records_without_timing_plot_the_step_time_alone():
    _, stacks = phase_series([record(0, 0.2), record(1, 0.1)])
    assert stacks == {"step": [200.0, 100.0]}


def test_throughput_and_cumulative_gradients_per_worker():
    steps = [record(0, 0.5, (0, 1)), record(1, 0.25, (1,)), record(2, 0.5, (0, 1))]
    assert throughput_series(steps, 64) == ([0, 1, 2], [128.0, 256.0, 128.0])
    assert gradient_series(steps) == {0: ([0, 1, 2], [1.0, 1.0, 2.0]), 1: ([0, 1, 2], [1.0, 2.0, 3.0])}


def test_y_limit_clips_only_a_far_outlier():
    assert y_limit([2000.0] + [20.0] * 19) == 80.0
    assert y_limit([30.0, 20.0, 25.0]) is None
