"""The doors of a two-machine cluster, for real: hosts A (launch: chief, ps, worker 0) and B (node:
worker 1) and an outsider C, one network namespace each on one bridge. While the cluster trains, C is
refused on every TF port of A and B, a member is not, `pstrain status` works and `doctor --run-dir` on
A says its rules are in place; the nftables rules are gone after a normal end, after SIGKILL of the
node, and after SIGKILL of the launcher."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import PSTRAIN, ROOT, Result, alive, assert_no_orphans, descendant_pids, step_lines, with_session_flags
from tests.netns import Host, lan, netns_tier
from tests.system.two_hosts import node_argv, write_two_host_job

pytestmark = [*netns_tier(), pytest.mark.skipif(shutil.which("nft") is None, reason="nft (nftables) is not installed")]

SUBNET = "10.252.7"
TF_PORTS = {"a": [2220, 2221, 2222], "b": [2222]}  # chief, ps, worker 0 on A; worker 1 on B
DOCTOR = """\
import json, sys
from cluster.doctor.run import run_doors
from cluster.rundir import RunDir
print(json.dumps([c.as_dict() for c in run_doors(RunDir(sys.argv[1]))]))
"""
PROBE = """\
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        out[target] = "connected"
    except ConnectionRefusedError:
        out[target] = "refused"
    except OSError as e:
        out[target] = type(e).__name__
print(json.dumps(out))
"""


def probe(host: Host, targets: list[str]) -> dict[str, str]:
    """Connect from `host` to each HOST:PORT: connected, refused, or why not."""
    done = subprocess.run(host.command([sys.executable, "-c", PROBE, *targets]), capture_output=True, text=True, timeout=60)
    return json.loads(done.stdout)


def tables(host: Host) -> list[str]:
    listing = subprocess.run(host.command(["nft", "list", "tables"]), capture_output=True, text=True, timeout=30).stdout
    return [line.split()[-1] for line in listing.splitlines() if "pstrain_" in line]


def start(tmp_path: Path, hosts: dict[str, Host], steps: int) -> tuple[list[subprocess.Popen], str, Path]:
    a, b = hosts["a"], hosts["b"]
    config, token = write_two_host_job(
        tmp_path, hosts, cluster={"heartbeat_timeout": 5.0}, steps=steps, checkpoint_every=50, run_dir=tmp_path / "run"
    )
    launch_argv = with_session_flags(["launch", "--config", str(config)])
    processes = [
        subprocess.Popen(
            host.command(PSTRAIN + argv), cwd=ROOT, stdout=open(tmp_path / f"{name}.out", "w"), stderr=subprocess.STDOUT
        )
        for host, argv, name in ((a, launch_argv, "launch"), (b, node_argv(a, token, tmp_path / "node"), "node"))
    ]
    return processes, str(token), tmp_path / "run"


def until(condition, processes, seen: set[int], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        seen |= descendant_pids(p.pid for p in processes)
        assert time.monotonic() < deadline and processes[0].poll() is None, "the cluster never got there"
        time.sleep(0.2)


def reap(processes, seen: set[int]) -> None:
    """Every process of the run gone (the tasks of a killed launcher or node exit by their death
    signal, which takes a moment on busy cores: awaited); whatever is left is killed after the check."""
    for p in processes:
        if p.poll() is None:
            p.kill()
        p.wait()
    try:
        assert_no_orphans(Result(0, "", seen))
    finally:
        for p in alive(seen):
            p.kill()


def test_an_outsider_is_refused_on_every_tf_port_while_members_train_and_the_rules_go_at_the_end(tmp_path):
    with lan("pd", {"a": ["ha"], "b": ["hb"], "c": ["hc"]}, SUBNET) as hosts:
        a, b, c = hosts["a"], hosts["b"], hosts["c"]
        processes, token, run_dir = start(tmp_path, hosts, steps=300)
        seen: set[int] = set()
        try:
            until(lambda: step_lines(run_dir) >= 20, processes, seen)
            targets = [f"{hosts[h].address}:{p}" for h, ports in TF_PORTS.items() for p in ports]
            outsider = probe(c, targets)
            member = probe(b, [f"{a.address}:2221"])
            during = {"a": tables(a), "b": tables(b)}
            doctor_argv = a.command([sys.executable, "-c", DOCTOR, str(run_dir)])
            doctor = subprocess.run(doctor_argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
            status = subprocess.run(
                c.command(PSTRAIN + ["status", "--chief", f"{a.address}:2229", "--token-file", token, "--json"]),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            codes = [p.wait(timeout=300) for p in processes]
        finally:
            reap(processes, seen)
        after = {"a": tables(a), "b": tables(b)}
    output = (tmp_path / "launch.out").read_text() + (tmp_path / "node.out").read_text()
    assert outsider == dict.fromkeys(targets, "refused"), outsider
    assert member == {f"{a.address}:2221": "connected"}, "a member reaches the ps"
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "training", status.stderr
    assert all(len(t) == 1 for t in during.values()), during
    rules = [c for c in json.loads(doctor.stdout or "[]") if c["name"] == "doors.rules"]
    assert [(c["level"], c["message"].split(" (")[0]) for c in rules] == [("INFO", f"nftables table {during['a'][0]}")], doctor
    assert "in place: TF ports 2220, 2221, 2222" in rules[0]["message"], "doctor --run-dir on A: the rules and their ports"
    warned = [c["name"] for c in json.loads(doctor.stdout) if c["level"] != "INFO"]
    assert warned == [], f"the TF ports behind the rules are not open to any host: {warned}"
    assert codes == [0, 0], output
    assert after == {"a": [], "b": []}, "the rules outlive the run"
    assert "TF ports 2220, 2221, 2222 closed to all but the cluster's hosts" in output
    assert "TF ports 2222 closed to all but the cluster's hosts" in output


def test_the_rules_go_when_the_node_and_the_launcher_are_killed(tmp_path):
    with lan("pk", {"a": ["ha"], "b": ["hb"]}, SUBNET.replace("7", "8")) as hosts:
        a, b = hosts["a"], hosts["b"]
        processes, _, run_dir = start(tmp_path, hosts, steps=5000)
        seen: set[int] = set()
        try:
            until(lambda: step_lines(run_dir) >= 5 and tables(a) and tables(b), processes, seen)
            launcher, node = processes
            node.kill()  # SIGKILL: no finally of the node runs; its guardian sees its stdin close
            node.wait()
            until(lambda: not tables(b), processes, seen, timeout_s=30)
            launcher.kill()
            launcher.wait()
            deadline = time.monotonic() + 30
            while tables(a) and time.monotonic() < deadline:
                time.sleep(0.2)
            after = {"a": tables(a), "b": tables(b)}
        finally:
            reap(processes, seen)
    assert after == {"a": [], "b": []}
