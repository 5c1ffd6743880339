"""The node rules' guardian (cluster/launch/firewall.py) in a network namespace of the test's own, with
the real nft (and the real iptables where installed): a stop signal at any moment of its life leaves no
rules behind, and a guardian that hangs is killed by its launcher, which deletes the rules itself, in
bounded time."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.helpers import ROOT
from tests.netns import netns_tier, two_hosts

pytestmark = netns_tier()
TOOLS = [
    pytest.param("nft", marks=pytest.mark.skipif(shutil.which("nft") is None, reason="nft (nftables) is not installed")),
    pytest.param(
        "iptables",
        marks=pytest.mark.skipif(shutil.which("ip6tables-restore") is None, reason="iptables (with ip6tables) is not installed"),
    ),
]
LIST = {"nft": [["nft", "list", "tables"]], "iptables": [["iptables", "-w", "-S"], ["ip6tables", "-w", "-S"]]}


@pytest.fixture
def namespace() -> Iterator[list[str]]:
    """`ip netns exec NAME` of a fresh namespace, removed afterwards (its nft tables with it)."""
    name = f"pst-fw-{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def tables(inside: list[str], tool: str = "nft") -> list[str]:
    """Every line of the tool's own listing that names pstrain's rules (iptables: the chain and its jump)."""
    lines = []
    for argv in LIST[tool]:
        listing = subprocess.run([*inside, *argv], capture_output=True, text=True, timeout=30, check=True)
        lines += [line for line in listing.stdout.splitlines() if "pstrain_" in line]
    return lines


def guardian(inside: list[str], tool: str) -> subprocess.Popen:
    argv = [*inside, sys.executable, "-m", "cluster.launch.firewall", "guard", tool, "2222,2223", "10.0.0.1,fd00::1"]
    return subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("tool", TOOLS)
def test_a_stop_signal_at_any_moment_of_the_guardians_life_leaves_no_rules(namespace, tool):
    first = guardian(namespace, tool)  # exec'd in place by ip netns exec: the guardian's pid
    began = time.monotonic()
    name = first.stdout.readline().decode().strip()
    to_ready = time.monotonic() - began
    made = tables(namespace, tool)
    assert name == f"pstrain_{first.pid}" and made and all(name in line for line in made), made
    first.send_signal(signal.SIGTERM)  # while it waits on its stdin
    assert first.wait(timeout=30) == 0 and tables(namespace, tool) == []
    first.communicate()
    codes = set()
    for i in range(12):  # from its start-up through the making of the table to its wait
        process = guardian(namespace, tool)
        time.sleep(to_ready * i / 8)
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
        codes.add(process.returncode)
        left = tables(namespace, tool)
        assert left == [], f"SIGTERM {to_ready * i / 8:.3f}s after the start left {left} (it said {out!r})"
    assert codes <= {0, -signal.SIGTERM}, codes


STUBBORN = """\
import json, subprocess, sys, time
import psutil
from cluster import rulesets
from cluster.launch import firewall
hang = "import signal,time;signal.signal(signal.SIGTERM,signal.SIG_IGN);print('up',flush=True);time.sleep(600)"
p = subprocess.Popen([sys.executable, "-c", hang], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
p.stdout.readline()
ruleset = rulesets.nft_ruleset(rulesets.name(p.pid), [2222], ["10.0.0.1"])
subprocess.run(["nft", "-f", "-"], input=ruleset, text=True, check=True)
began = time.monotonic()
firewall.end_guardian(p, "nft", 1.0)
took = time.monotonic() - began
tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
print(json.dumps({"took": took, "alive": psutil.pid_exists(p.pid), "tables": tables, "closed": p.stdout.closed}))
"""


@pytest.mark.skipif(shutil.which("nft") is None, reason="nft (nftables) is not installed")
def test_a_guardian_that_hangs_is_killed_and_its_table_deleted_by_the_launcher(namespace):
    """Its stdin closed and SIGTERM ignored: `end_guardian` neither waits for ever nor raises, reaps it
    and deletes the table it would have deleted."""
    done = subprocess.run([*namespace, sys.executable, "-c", STUBBORN], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert 1.0 <= seen["took"] < 20, seen
    assert not seen["alive"] and seen["closed"] and "pstrain_" not in seen["tables"], seen


SERVE = """\
import socket
server = socket.create_server(("::", 2222), family=socket.AF_INET6, dualstack_ipv6=True)  # all interfaces, as TF
print("up", flush=True)
input()
"""
CONNECT = """\
import socket, sys
try:
    socket.create_connection((sys.argv[1], 2222), timeout=5).close()
    print("connected")
except ConnectionRefusedError:
    print("refused")
"""


@pytest.mark.parametrize("tool", TOOLS)
def test_the_rules_refuse_an_outsider_and_admit_a_member(tool):
    """Host A serves on all interfaces (as TF does); its guardian admits one peer: B is refused while
    it is not that peer, connects once it is, and nothing of the rules is left after either."""
    with two_hosts(tag=61) as (a, b):
        server = subprocess.Popen(a.command([sys.executable, "-c", SERVE]), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert server.stdout.readline() == b"up\n"
            seen = {}
            for peer in ("10.251.61.9", b.address):
                process = subprocess.Popen(
                    a.command([sys.executable, "-m", "cluster.launch.firewall", "guard", tool, "2222", peer]),
                    cwd=ROOT,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
                assert process.stdout.readline().startswith(b"pstrain_"), process.stderr.read()
                connect = b.command([sys.executable, "-c", CONNECT, a.address])
                probe = subprocess.run(connect, capture_output=True, text=True, timeout=60)
                process.stdin.close()
                assert process.wait(timeout=30) == 0
                process.stdout.close()
                process.stderr.close()
                seen[peer] = (probe.stdout.strip(), tables(a.command([]), tool))
        finally:
            server.stdin.close()
            server.wait(timeout=30)
    assert seen == {"10.251.61.9": ("refused", []), b.address: ("connected", [])}, seen
