"""The before/after harness's pure parts (tests/benchmarks/ab.py): its --configs and its summary."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmarks.ab import configs, summarize

pytestmark = pytest.mark.pure


def test_configs_are_workers_by_ps_and_bad_ones_name_the_flag():
    assert configs("1x2,4x2") == [(1, 2), (4, 2)]
    for bad in ("", "4", "4x0", "axb", "1x2x3"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"^--configs .*: give WORKERSxPS pairs"):
            configs(bad)


def test_summary_takes_medians_ranges_and_counts_the_rounds_the_after_side_won_at_step_and_start_up():
    def run(round_, side, ms, chief, start):
        cpu = {"chief": chief, "ps": 20.0}
        return {"config": "4x2", "round": round_, "side": side, "step_ms": ms, "cpu_ms": cpu, "startup_s": start}

    runs = [run(0, "before", 30.0, 5.0, 6.0), run(0, "after", 27.0, 1.0, 5.0), run(1, "after", 36.0, 1.2, 6.5)]
    runs += [run(1, "before", 34.0, 6.0, 6.2), run(2, "before", 40.0, 7.0, 5.8), run(2, "after", 31.0, 0.9, 5.2)]
    s = summarize(runs)["4x2"]
    assert s["before"] == {
        "median_ms": 34.0,
        "min_ms": 30.0,
        "max_ms": 40.0,
        "cpu_ms": {"chief": 6.0, "ps": 20.0},
        "startup_s": 6.0,
        "startup_range_s": [5.8, 6.2],
    }
    assert s["after"]["median_ms"] == 31.0 and s["after"]["cpu_ms"]["chief"] == 1.0
    assert (s["after_faster_rounds"], s["rounds"]) == (2, 3)
    assert s["after_over_before"] == pytest.approx(31.0 / 34.0)
    assert s["after"]["startup_s"] == 5.2 and s["startup_after_faster_rounds"] == 2  # rounds 0 and 2; round 1 slower
    assert s["startup_after_over_before"] == pytest.approx(5.2 / 6.0)
