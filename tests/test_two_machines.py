"""Two machines for real: two network namespaces joined by a veth pair, one host each.

Host A runs `pstrain launch` (chief, ps, worker 0); host B runs `pstrain node --chief A:PORT`
(worker 1), exactly the README's "Two machines" recipe.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time

import psutil
import pytest

from tests.helpers import PSTRAIN, ROOT, Result, alive, assert_no_orphans, metrics
from tests.netns import can_create_namespaces, two_hosts

WHY_NOT = can_create_namespaces()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=f"cannot create network namespaces here: {WHY_NOT}")

CONFIG = """\
[cluster]
chief = "{a}:2220"
control = "{a}:2229"
ps = ["{a}:2221"]
workers = ["{a}:2222", "{b}:2222"]
token_file = "{token}"

[train]
steps = {steps}
run_dir = "{run_dir}"
"""


def start(host, argv: list[str], log_path) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(host.command(PSTRAIN + argv), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)


def test_training_across_two_hosts(tmp_path):
    steps = 120
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(16) + "\n")
    run_dir = tmp_path / "run"
    seen: set[int] = set()
    with two_hosts() as (a, b):
        config = tmp_path / "cluster.toml"
        config.write_text(CONFIG.format(a=a.address, b=b.address, token=token, steps=steps, run_dir=run_dir))
        control = f"{a.address}:2229"
        launcher = start(a, ["launch", "--config", str(config)], tmp_path / "launch.out")
        node = start(
            b,
            ["node", "--chief", control, "--token-file", str(token), "--log-dir", str(tmp_path / "node")],
            tmp_path / "node.out",
        )
        statuses = []
        try:
            deadline = time.monotonic() + 300
            while launcher.poll() is None and time.monotonic() < deadline:
                for p in (launcher, node):
                    try:
                        seen |= {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
                    except psutil.NoSuchProcess:
                        pass
                if not statuses or statuses[-1].get("state") != "training":
                    # Ask from host B, as an operator on the second machine would.
                    status = subprocess.run(
                        b.command(PSTRAIN + ["status", "--chief", control, "--token-file", str(token), "--json"]),
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        timeout=60,
                    )
                    if status.returncode == 0:
                        statuses.append(json.loads(status.stdout))
                time.sleep(0.2)
            node_code = node.wait(timeout=60)
        finally:
            for p in (launcher, node):
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for p in alive(seen):
                p.kill()
        output = (tmp_path / "launch.out").read_text()
        assert launcher.returncode == 0, output + (tmp_path / "node.out").read_text()
        assert node_code == 0, (tmp_path / "node.out").read_text()
    records, done = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(steps))
    assert all(r["aggregated"] == 2 and r["workers"] == [0, 1] for r in records), "every step: both hosts' workers"
    training = [s for s in statuses if s["state"] == "training"]
    assert training, f"status never showed the cluster training: {statuses}"
    hosts = {row["task"]: row["host"] for row in training[-1]["tasks"]}
    assert hosts == {"chief:0": a.address, "ps:0": a.address, "worker:0": a.address, "worker:1": b.address}
    assert_no_orphans(Result(0, "", seen))
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert a.namespace not in namespaces and b.namespace not in namespaces
