"""`pstrain plan`'s flags and printed lines (cluster/forecast/report.py): pure."""

from __future__ import annotations

import pytest

from cluster.errors import ConfigError
from cluster.forecast.model import Piece, Prediction, Variable
from cluster.forecast.report import (
    bytes_line,
    costs_lines,
    dense_line,
    parse_bandwidth,
    parse_cores,
    parse_counts,
    parse_runs,
    placement_lines,
    table,
)

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [("10Gbit", 1.25e9), ("10Gbps", 1.25e9), ("25Gbit/s", 3.125e9), ("1.25GB/s", 1.25e9), ("100 Mbit", 1.25e7)],
)
def test_bandwidth_units(text, bytes_per_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["fast", "10", "0Gbit", "10GB", "-1Gbit", ""])
def test_bad_bandwidth_is_one_line_naming_the_flag(text):
    with pytest.raises(ConfigError, match=r"^--bandwidth: expected a rate like 10Gbit"):
        parse_bandwidth(text)


def test_counts_cores_and_runs():
    assert parse_bandwidth("loopback") is None
    assert parse_counts("--ps", "1,2,4") == [1, 2, 4]
    assert parse_cores("") is None and parse_cores("here") == "here" and parse_cores("8") == 8.0
    assert parse_runs("1x1, 2x1,1x2,2x2") == [(1, 1), (2, 1), (1, 2), (2, 2)]
    for flag, bad in (("--ps", "0,1"), ("--ps", "1,,2"), ("--workers", "x")):
        with pytest.raises(ConfigError, match=f"^{flag}: expected positive whole numbers"):
            parse_counts(flag, bad)
    with pytest.raises(ConfigError, match="^--cores: expected a number of cores above 0"):
        parse_cores("-2")
    with pytest.raises(ConfigError, match="^--measure: expected WORKERSxPS pairs"):
        parse_runs("1x1,2by1")
    with pytest.raises(ConfigError, match="^--measure: give at least two worker counts and two ps counts"):
        parse_runs("1x1,2x1")
    # the hybrid's runs: two worker counts on one ps are enough
    assert parse_runs("1x1,2x1", "--measure-allreduce", ps_counts=1) == [(1, 1), (2, 1)]
    with pytest.raises(ConfigError, match=r"^--measure-allreduce: give at least two worker counts \(like 1x1,2x1\), got '2x1'$"):
        parse_runs("2x1", "--measure-allreduce", ps_counts=1)


def test_table_and_placement_lines():
    p = Prediction(
        0.010,
        6400.0,
        "ps CPU",
        {"worker compute": 0.004, "ps CPU": 0.010, "ps network": 0.002, "chief": 0.001},
        (0.010, 0.008),
        (3 * 2**20, 2**20),
    )
    lines = table([(16, 2, p)])
    assert (
        lines[0] == "| workers | ps | step ms | examples/s | worker compute ms | ps CPU ms | ps network ms | chief ms | binds |"
    )
    assert lines[2] == "| 16 | 2 | 10.00 | 6,400 | 4.00 | 10.00 | 2.00 | 1.00 | ps CPU |"
    placed = placement_lines([Piece("t:0", 0.5, 0), Piece("t:0", 0.5, 1), Piece("b:0", 1.0, 1)], p)
    assert placed == ["  ps:0: CPU 10.00 ms, 3.00 MiB per step: t (1/2)", "  ps:1: CPU 8.00 ms, 1.00 MiB per step: t (1/2), b"]
    line = bytes_line([Variable("t:0", 2**20, 1024, 2048, 2048, row_sparse=True), Variable("b:0", 64, 16, 64, 64)])
    assert line.endswith("2 variables; row-sparse: t 2.0 KiB of 1.0 MiB")


def test_both_dense_modes_in_one_table_and_the_choice_with_what_binds():
    by_ps = Prediction(
        0.010, 6400.0, "ps CPU", {"worker compute": 0.004, "ps CPU": 0.010, "ps network": 0.002, "chief": 0.001}, (0.01,), (1.0,)
    )
    loads = {"worker compute": 0.006, "ps CPU": 0.003, "ps network": 0.001, "worker network": 0.005, "chief": 0.001}
    hybrid = Prediction(0.006, 64 / 0.006, "worker compute", loads, (0.003,), (1.0,))
    lines = table([(16, 1, by_ps), (16, 1, hybrid)], ["ps", "allreduce"])
    assert lines[0] == (
        "| dense | workers | ps | step ms | examples/s | worker compute ms | ps CPU ms | ps network ms | worker network ms"
        " | chief ms | binds |"
    )
    assert lines[1] == "|---" * 11 + "|"
    assert lines[2] == "| ps | 16 | 1 | 10.00 | 6,400 | 4.00 | 10.00 | 2.00 | - | 1.00 | ps CPU |"
    assert lines[3] == "| allreduce | 16 | 1 | 6.00 | 10,667 | 6.00 | 3.00 | 1.00 | 5.00 | 1.00 | worker compute |"
    chosen = dense_line(16, 1, by_ps, hybrid, "")
    want = '  16 workers, 1 ps: train.dense = "allreduce" ("allreduce" 6.00 ms, bound by worker compute; '
    assert chosen == want + '"ps" 10.00 ms, bound by ps CPU)'
    close = Prediction(0.0098, 64 / 0.0098, "worker network", loads, (0.003,), (1.0,))
    assert dense_line(16, 1, by_ps, close, "").endswith('"allreduce" 9.80 ms, bound by worker network: not 5 % faster)')
    refused = dense_line(16, 2, by_ps, None, "the dense variable w would be split over 2 ps; it takes --ps 1")
    assert refused == (
        '  16 workers, 2 ps: train.dense = "ps" ("ps" 10.00 ms, bound by ps CPU); "allreduce" is refused there: '
        "the dense variable w would be split over 2 ps; it takes --ps 1"
    )


def test_the_hybrids_runs_are_checked_before_any_run():
    import argparse

    from cluster.forecast.command import checked

    def args(**changes) -> argparse.Namespace:
        base = dict(job="chief.jobs.digits", global_batch_size=64, measure_steps=200, measure_repeats=1, rtt=0.1)
        base |= dict(measure="1x1,2x1,1x2,2x2")
        base |= dict(measure_allreduce="1x1,2x1", workers="16", ps="1", bandwidth="1Gbit", cores="")
        return argparse.Namespace(**(base | changes))

    assert checked(args())["allreduce_runs"] == [(1, 1), (2, 1)]
    assert checked(args(measure_allreduce=""))["allreduce_runs"] == []
    with pytest.raises(ConfigError, match=r"^--measure-allreduce: runs on 1 ps only \(.*\), got 2 ps$"):
        checked(args(measure_allreduce="1x1,2x2"))
    with pytest.raises(ConfigError, match=r"^--global-batch-size: 64 does not split over 3 workers \(--measure-allreduce\)$"):
        checked(args(measure_allreduce="1x1,3x1"))
    with pytest.raises(ConfigError, match=r"^--global-batch-size: 64 does not split over 3 workers \(--measure\)$"):
        checked(args(measure="1x1,3x1,1x2"))
    with pytest.raises(ConfigError, match=r"^--measure-repeats: expected a positive whole number, got 0$"):
        checked(args(measure_repeats=0))


def test_the_hybrids_fitted_costs_get_a_line_of_their_own():
    from cluster.forecast.model import Costs, HybridCosts

    costs = Costs(*([0.001] * 10), cores=1.5)
    assert len(costs_lines(costs, 64)) == 4
    line = costs_lines(costs, 64, HybridCosts(0.012, 0.004, 0.002, 0.0015))[3]
    assert line == (
        '  with train.dense = "allreduce": worker 12.00 ms per step + its share of the batch + 4.00 ms per further worker'
        " (the exchange); ps 2.00 ms per step + 1.50 ms per worker"
    )


def test_a_link_shows_the_series_that_binds_as_a_column_of_its_own():
    from cluster.forecast.model import Costs, Scenario, Variable, predict, pstrain_placement

    ms = 1e-3
    costs = Costs(2 * ms, 0.2 * ms, 0.5 * ms, 1 * ms, 0.2 * ms, 1 * ms, 0.5 * ms, 0.01 * ms, 0.0, 0.1 * ms, 2.0)
    v = [
        Variable("table", 256 << 20, 1_000_000, 400_000, 400_000, row_sparse=True),
        Variable("kernel", 16_384, 64, 16_384, 16_384),
    ]
    on_link = predict(costs, v, pstrain_placement(v, 1), Scenario(4, 1, 128, 1.25e8))
    lines = table([(4, 1, on_link)])
    assert "| ps network ms | worker compute + network ms | chief ms | binds |" in lines[0]
    cells = lines[2].split(" | ")
    # the step is the series' column, and the row names it as what binds
    assert cells[2] == cells[7] == f"{on_link.step_s * 1e3:.2f}" and lines[2].endswith("| worker compute + network |")
