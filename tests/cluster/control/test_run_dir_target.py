"""`pstrain status|stop|doctor --run-dir DIR`: control.json as written and read back, the control plane
it names reached over a real gRPC server (a unix socket target too), and how fresh the shown step is."""

from __future__ import annotations

import json
import os

import pytest

from cluster import cli, rundir
from cluster.control.client import freshest_step
from cluster.control.registry import Registry
from cluster.control.security import Credentials
from cluster.control.service import ControlService, serve
from cluster.control.status_table import format_status
from cluster.versions import local_versions

pytestmark = pytest.mark.pure
EXPECTED = {("chief", 0): "h:1", ("ps", 0): "h:2", ("worker", 0): "h:3"}


def served(tmp_path, bind: str, target: str):
    """A real control plane on `bind`, and a run dir whose control.json names it as `target`."""
    registry = Registry(EXPECTED, local_versions(), heartbeat_timeout=5, total_steps=100)
    stops: list[str] = []
    servicer = ControlService(
        registry, 1.0, lambda reason: (stops.append(reason), registry.request_stop(reason)), lambda h: ({}, [])
    )
    server, port = serve(servicer, bind, Credentials("the-token"))
    run_dir = tmp_path / "run"
    rundir.write_secret(rundir.RunDir(run_dir).control_token, "the-token")
    rundir.write_control(rundir.RunDir(run_dir), rundir.ControlRecord(target.replace(":0", f":{port}"), "local", "control.token"))
    return server, registry, stops, run_dir


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_status_and_stop_reach_the_control_plane_that_control_json_names(tmp_path, capsys, kind):
    """The record holds a gRPC target string: HOST:PORT, or unix:PATH (a control plane on a socket in
    the run dir, as a cluster in a network namespace may serve it); the token comes from the run dir."""
    sock = tmp_path / "control.sock"
    bind = "127.0.0.1:0" if kind == "tcp" else f"unix:{sock}"
    server, registry, stops, run_dir = served(tmp_path, bind, bind)
    try:
        registry.register(("chief", 0), "box", "h:1", os.getpid(), local_versions(), [])
        registry.heartbeat(("chief", 0), "training", {}, 42, {})
        assert cli.main(["status", "--run-dir", str(run_dir), "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["state"] == "training" and status["step"] == 42 and 0 <= status["step_age_s"] < 5
        assert cli.main(["stop", "--run-dir", str(run_dir)]) == 0
        assert stops and stops[0].startswith("pstrain stop from ") and registry.stop_reason == stops[0]
    finally:
        server.stop(grace=0)


def test_a_wrong_token_and_a_gone_control_plane_are_one_line_each(tmp_path, capsys):
    server, _, _, run_dir = served(tmp_path, "127.0.0.1:0", "127.0.0.1:0")
    try:
        (tmp_path / "bad.token").write_text("wrong\n")
        assert cli.main(["status", "--run-dir", str(run_dir), "--token-file", str(tmp_path / "bad.token")]) == 2
        assert capsys.readouterr().err.startswith("pstrain: error: --token-file: the chief at 127.0.0.1:")
    finally:
        server.stop(grace=0)
    assert cli.main(["status", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pstrain: error: --run-dir: no control plane answers at 127.0.0.1:") and err.count("\n") == 1, err


def test_control_json_round_trips_and_is_removed_only_by_its_writer(tmp_path):
    record = rundir.ControlRecord("unix:/run/x.sock", "slurm", "/secrets/token", "", "node1", 7)
    run_dir = rundir.RunDir(tmp_path)
    rundir.write_control(run_dir, record)
    assert rundir.read_control(run_dir) == record
    later = rundir.ControlRecord("10.0.0.1:2223", "local", "control.token")
    rundir.write_control(run_dir, later)
    rundir.remove_control(run_dir, record)  # an older launch ending does not remove a newer launch's record
    assert rundir.read_control(run_dir) == later
    rundir.remove_control(run_dir, later)
    assert not run_dir.control_record.exists()


def test_the_shown_step_is_the_newest_known_and_says_how_old_it_is(tmp_path):
    """metrics.jsonl ahead of the chief's last report (a block ended after its heartbeat): its step is
    shown, with the age of its line; behind it, the chief's report stands."""
    lines = [{"step": s, "loss": 1.0, "time": 1000.0 + s} for s in range(449)]
    rundir.RunDir(tmp_path).metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    status = {"state": "training", "step": 129, "step_age_s": 0.5, "total_steps": 1000, "tasks": []}
    newer = freshest_step(status, rundir.RunDir(tmp_path), now=1000.0 + 448 + 2.5)
    assert newer["step"] == 449 and newer["step_age_s"] == 2.5 and newer["step_from"] == "metrics.jsonl"
    assert format_status(newer).splitlines()[0] == "cluster training, step 449/1000 (2.5s old, from metrics.jsonl)"
    assert freshest_step({**status, "step": 449}, rundir.RunDir(tmp_path), now=2000.0)["step_age_s"] == 0.5
    assert format_status({**status, "step_age_s": -1.0}).splitlines()[0] == "cluster training, step 129/1000"


def test_the_registry_says_how_old_the_chiefs_step_is():
    now = [100.0]
    registry = Registry(EXPECTED, local_versions(), heartbeat_timeout=5, clock=lambda: now[0])
    assert registry.status()["step_age_s"] == -1.0
    registry.register(("chief", 0), "box", "h:1", 1, local_versions(), [])
    registry.heartbeat(("chief", 0), "training", {}, 64, {})
    now[0] += 3
    registry.heartbeat(("chief", 0), "training", {}, 64, {})  # the same step again: its age goes on
    assert registry.status()["step_age_s"] == 3.0
    registry.heartbeat(("chief", 0), "training", {}, 128, {})
    assert registry.status()["step_age_s"] == 0.0


def test_a_relative_unix_socket_is_recorded_absolute(tmp_path, monkeypatch):
    """A control plane on a socket in the run dir, named relative to the launcher's directory, is
    recorded so that status from any directory reaches it."""
    from cluster.launch.launcher import client_target

    monkeypatch.chdir(tmp_path)
    assert client_target("unix:runs/x/control.sock") == f"unix:{tmp_path}/runs/x/control.sock"
    assert client_target("unix:/abs/control.sock") == "unix:/abs/control.sock"
    assert client_target("10.0.0.1:2223") == "10.0.0.1:2223"
