"""The node rules' guardian (cluster/launch/firewall.py) in a network namespace of the test's own, with
the real nft: a stop signal at any moment of its life leaves no table behind, and a guardian that hangs
is killed by its launcher, which deletes the table itself, in bounded time."""

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
from tests.netns import netns_tier

pytestmark = [*netns_tier(), pytest.mark.skipif(shutil.which("nft") is None, reason="nft (nftables) is not installed")]


@pytest.fixture
def namespace() -> Iterator[list[str]]:
    """`ip netns exec NAME` of a fresh namespace, removed afterwards (its nft tables with it)."""
    name = f"pst-fw-{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def tables(inside: list[str]) -> list[str]:
    listing = subprocess.run([*inside, "nft", "list", "tables"], capture_output=True, text=True, timeout=30, check=True)
    return [line.split()[-1] for line in listing.stdout.splitlines() if "pstrain_" in line]


def guardian(inside: list[str]) -> subprocess.Popen:
    argv = [*inside, sys.executable, "-m", "cluster.launch.firewall", "guard", "2222,2223", "10.0.0.1"]  # exec'd in place
    return subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_stop_signal_at_any_moment_of_the_guardians_life_leaves_no_table(namespace):
    first = guardian(namespace)
    began = time.monotonic()
    table = first.stdout.readline().decode().strip()
    to_ready = time.monotonic() - began
    assert table.startswith("pstrain_") and tables(namespace) == [table]
    first.send_signal(signal.SIGTERM)  # while it waits on its stdin
    assert first.wait(timeout=30) == 0 and tables(namespace) == []
    first.communicate()
    codes = set()
    for i in range(12):  # from its start-up through the making of the table to its wait
        process = guardian(namespace)
        time.sleep(to_ready * i / 8)
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
        codes.add(process.returncode)
        left = tables(namespace)
        assert left == [], f"SIGTERM {to_ready * i / 8:.3f}s after the start left {left} (it said {out!r})"
    assert codes <= {0, -signal.SIGTERM}, codes


STUBBORN = """\
import json, subprocess, sys, time
import psutil
from cluster import doors
from cluster.launch import firewall
hang = "import signal,time;signal.signal(signal.SIGTERM,signal.SIG_IGN);print('up',flush=True);time.sleep(600)"
p = subprocess.Popen([sys.executable, "-c", hang], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
p.stdout.readline()
ruleset = doors.nft_ruleset(doors.table_name(p.pid), [2222], ["10.0.0.1"])
subprocess.run(["nft", "-f", "-"], input=ruleset, text=True, check=True)
began = time.monotonic()
firewall.end_guardian(p, 1.0)
took = time.monotonic() - began
tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
print(json.dumps({"took": took, "alive": psutil.pid_exists(p.pid), "tables": tables, "closed": p.stdout.closed}))
"""


def test_a_guardian_that_hangs_is_killed_and_its_table_deleted_by_the_launcher(namespace):
    """Its stdin closed and SIGTERM ignored: `end_guardian` neither waits for ever nor raises, reaps it
    and deletes the table it would have deleted."""
    done = subprocess.run([*namespace, sys.executable, "-c", STUBBORN], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert 1.0 <= seen["took"] < 20, seen
    assert not seen["alive"] and seen["closed"] and "pstrain_" not in seen["tables"], seen
