"""--link for real: shaped network-namespace hosts carry their rate and no more, every benchmark task
runs on a host of its own, `pstrain plan`'s link model holds against a shaped pstrain run, and
nothing (namespace, veth, bridge, process) outlives a run, on a normal end and on SIGTERM.

A smoke size: the 1 M MLP for 60 steps on 1gbit ports (134 ms a step at the link's rate).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.benchmarks import links
from tests.helpers import ROOT, Result, assert_no_orphans, descendant_pids
from tests.netns import lan, netns_tier

pytestmark = netns_tier()
RATE = links.LINKS["1gbit"]


def hosts_of(pid: int) -> list[str]:
    """The --link namespaces the process `pid` made (tests.netns.lan's names end in its pid), and their
    /etc/netns folders (a veth or bridge lives in a namespace and goes with it)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    names += [f"/etc/netns/{p.name}" for p in Path("/etc/netns").glob("*")] if Path("/etc/netns").is_dir() else []
    return [n for n in names if n.split("/")[-1].startswith(links.PREFIX) and n.endswith(f"-{pid % 100000}")]


def network_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


def test_a_shaped_port_carries_its_rate_and_no_more():
    with links.shaped_hosts(2, RATE) as (a, b):
        qdisc = subprocess.run(a.command(["tc", "qdisc", "show", "dev", a.device]), capture_output=True, text=True).stdout
        shaped = links.measure_rate(a, b, 64 << 20)
        back = links.measure_rate(b, a, 64 << 20)  # what a receives: the bridge's end of its veth is shaped too
    with lan(links.PREFIX, {"h0": ["h0"], "h1": ["h1"]}, links.SUBNET) as hosts:
        free = links.measure_rate(*hosts.values(), 64 << 20)
    assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc
    for run in (shaped, back):
        assert run["bytes"] == 64 << 20
        # TCP/IP headers take ~4 % of the 1500-byte frames tbf counts; 2 busy cores may take more.
        assert 0.75 * RATE <= run["bytes_per_s"] <= 1.02 * RATE, run
    assert free["bytes_per_s"] > 1.5 * RATE, f"unshaped, the same veth moves more: {free}"
    assert not hosts_of(os.getpid()) and not descendant_pids([os.getpid()])


def test_a_ring_exchange_moves_both_ways_at_once():
    """The hybrid's exchange between two shaped hosts (links.gather_probe, from this process): each
    worker sends its 16 MiB while it receives the other's, so a gather and an all-reduce take about one
    way's time at the rate, not two (links.allreduce_limit counts the exchange once). Both TF tasks are
    reaped and both hosts removed."""
    got = links.gather_probe(RATE, 16 << 20)
    assert got["bytes_each_way"] == 16 << 20 and got["one_way_s"] == (16 << 20) / RATE
    for key in ("gather_s", "reduce_s"):  # no faster than the link; well short of both ways in turn
        assert 0.95 * got["one_way_s"] <= got[key] <= 1.75 * got["one_way_s"], got
    assert not hosts_of(os.getpid()) and not descendant_pids([os.getpid()])


def test_bench_on_1gbit_runs_each_task_on_its_own_host_and_plan_holds(tmp_path):
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "tests.benchmarks.bench", "--sizes", "1m", "--peers", "pstrain", "--repeats", "1"]
    argv += ["--steps", "60", "--warmup-rounds", "0", "--link", "1gbit", "--out", str(out)]
    bench = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    networks: set[str] = set()
    deadline = time.monotonic() + 600
    while bench.poll() is None and time.monotonic() < deadline:
        now = descendant_pids([bench.pid])
        seen |= now
        tasks = [p for p in now if "TF_CONFIG" in _environ(p)]  # pstrain's and the probes' TF tasks
        networks |= {network_of(p) for p in tasks}
        time.sleep(0.5)
    output = bench.communicate(timeout=60)[0]
    assert bench.returncode == 0, output[-3000:]
    assert_no_orphans(Result(0, "", seen))
    assert not hosts_of(bench.pid), "every host of the run is removed"
    mine = network_of(os.getpid())
    hosts = {n for n in networks if n and n != mine}
    assert len(hosts) >= 4, f"chief, ps and 2 workers each on a host of its own: {hosts}"
    result = json.loads(out.read_text())
    assert result["link"]["name"] == "1gbit" and 0.75 * RATE <= result["link"]["bytes_per_s"] <= 1.02 * RATE
    entry = result["links"]["1m"]
    limit, plan = entry["transfer_limit"], entry["plan"]
    assert limit["busiest_port_bytes"] == 2 * (entry["pull_bytes_per_worker"] + entry["push_bytes_per_worker"])
    assert limit["pstrain_step_over_limit"] >= 0.9, "a step cannot beat its link"
    assert plan["binding"] == "ps network" and plan["within_25pct"], plan
    assert "1m on 1gbit (pstrain): transfer limit" in output


def _environ(pid: int) -> dict:
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {}


def test_sigterm_removes_every_host_and_process():
    argv = [sys.executable, "-m", "tests.benchmarks.bench", "--sizes", "1m", "--peers", "tf1", "--repeats", "1"]
    argv += ["--steps", "4000", "--warmup-rounds", "0", "--link", "1gbit"]  # 4000 x 256: within the drawn examples
    bench = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    deadline = time.monotonic() + 180
    mine = network_of(os.getpid())
    while time.monotonic() < deadline and bench.poll() is None:
        seen |= descendant_pids([bench.pid])
        if len({network_of(p) for p in seen} - {mine, ""}) >= 3:  # the ps and both workers on their hosts
            break
        time.sleep(0.3)
    assert len({network_of(p) for p in seen} - {mine, ""}) >= 3, "the tf1 peer's ps and workers ran on their hosts"
    assert hosts_of(bench.pid), "the run's hosts exist while it runs"
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=120) == 128 + signal.SIGTERM
    assert_no_orphans(Result(0, "", seen))
    assert not hosts_of(bench.pid)


def test_where_namespaces_cannot_be_made_link_is_refused_in_one_line():
    """As an unprivileged user (nobody): `ip netns add` needs root, so --link 1gbit is refused, exit 2."""
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    argv = [*nobody, sys.executable, "-m", "tests.benchmarks.bench", "--sizes", "", "--link", "1gbit"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "HOME": "/tmp"})
    said = [line for line in done.stderr.splitlines() if line.startswith("--link")]
    assert done.returncode == 2, done.stderr[-2000:]
    why = "creating network namespaces needs root"
    assert said == [f"--link: cannot make network-namespace hosts here ({why}); run with --link loopback"]
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_hosts_a_killed_invocation_left_are_swept_and_a_live_ones_kept():
    live = os.getpid()
    dead = next(pid for pid in range(30000, 1, -1) if pid % 100000 not in {p % 100000 for p in psutil.pids()})
    names = [f"{links.PREFIX}h0-{dead}", f"{links.PREFIX}sw-{dead}", f"{links.PREFIX}h0-{live % 100000}"]
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
        links.sweep()
        assert not hosts_of(dead) and hosts_of(live) == [names[2]]
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
