"""--link's decisions (tests/benchmarks/links.py): the flag, tbf's parameters, the transfer limit, plan's error."""

from __future__ import annotations

import pytest

from tests.benchmarks import links

pytestmark = pytest.mark.pure


def test_links_are_loopback_and_two_rates():
    assert links.parse_link("loopback") is None
    assert links.parse_link("1gbit") == 125e6 and links.parse_link("10gbit") == 1.25e9


@pytest.mark.parametrize("text", ["1Gbit", "100mbit", "", "fast"])
def test_an_unknown_link_is_one_line_naming_the_flag(text):
    with pytest.raises(links.LinkError, match=r"^--link: expected one of loopback, 1gbit, 10gbit, got ") as caught:
        links.parse_link(text)
    assert "\n" not in str(caught.value)
    assert links.use(text).startswith("--link: expected one of") and links.name() == "loopback"


def test_tbf_gives_the_rate_a_millisecond_bucket_and_at_least_two_gso_segments():
    assert links.tbf(125e6) == ["tbf", "rate", "1000000000bit", "burst", str(128 << 10), "latency", "50ms"]
    assert links.tbf(1.25e9) == ["tbf", "rate", "10000000000bit", "burst", "1250000", "latency", "50ms"]


def test_transfer_limit_counts_the_ps_ports_bytes_both_ways():
    # 2 workers each pull and push 4 MB through one ps: 16 MB through its port, 128 ms at 1 Gbit.
    got = links.transfer_limit(4e6, 4e6, workers=2, ps=1, rate=125e6)
    assert got == {"busiest_port_bytes": 16e6, "rate_bytes_per_s": 125e6, "limit_s": pytest.approx(0.128)}
    # Four ps share it; then a worker's own port (8 MB) is the busiest.
    assert links.transfer_limit(4e6, 4e6, workers=2, ps=4, rate=125e6)["busiest_port_bytes"] == 8e6


def test_the_hybrids_transfer_limit_counts_a_workers_ring_gather_and_the_ps_tables():
    # 2 workers exchange 4 MB of dense gradients (one each way at once: counted once) and 1 MB of table rows.
    got = links.allreduce_limit(1e6, 4e6, workers=2, rate=125e6)
    assert got == {"busiest_port_bytes": 5e6, "rate_bytes_per_s": 125e6, "limit_s": pytest.approx(0.04)}
    # 4 workers: a ring gather takes 3 gradients in and sends 3 out.
    assert links.allreduce_limit(1e6, 4e6, workers=4, rate=125e6)["busiest_port_bytes"] == 13e6
    # Tables alone (no dense gradient): the ps's port carries every worker's rows.
    assert links.allreduce_limit(1e6, 0.0, workers=4, rate=125e6)["busiest_port_bytes"] == 4e6


def test_plan_error_against_the_25_percent_target():
    want = {"predicted_s": 0.1, "measured_s": 0.125, "error": pytest.approx(-0.2), "within_25pct": True}
    assert links.plan_error(0.1, 0.125) == want
    assert not links.plan_error(0.1, 0.2)["within_25pct"]


def test_stale_hosts_are_only_those_whose_maker_is_gone():
    names = ["pstlh0-4242", "pstlsw-4242", "pstlh1-777", "pst-a-4242", "pstlh0-x"]
    assert links.stale(names, pids=[1, 777]) == ["pstlh0-4242", "pstlsw-4242"]
    assert links.stale(names, pids=[104242, 777]) == []  # suffixes are pids mod 100000: a live maker's stay


def test_plan_fit_is_checked_before_any_run():
    want = "--plan-fit: plan's step is held against shaped runs only; give --link 1gbit or 10gbit"
    assert links.use("loopback", "1x1,2x1,1x2,2x2") == want
    assert links.use("1gbit", "2by2").startswith("--plan-fit: expected WORKERSxPS pairs like 1x1,2x1,1x2,2x2, got '2by2'")
    assert links.name() == "loopback"
