"""The control plane: proto, registry rules, token checks, and status of a live local cluster."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import psutil
import pytest

from cluster.control.proto import control_pb2 as pb
from cluster.control.proto.generate import generated_files
from cluster.control.registry import Registry
from cluster.control.security import Credentials
from cluster.control.service import ControlService, serve, status_dict, status_message, stub
from cluster.doctor.listeners import listeners, parse_table
from cluster.doctor.run import run_doors
from cluster.rundir import RunDir
from cluster.runlock import read_holder
from cluster.versions import local_versions
from tests.helpers import PSTRAIN, ROOT, assert_no_orphans, lost_worker_warning, metrics, run_pstrain

VERSIONS = {"pstrain": "1.0", "tensorflow": "2.21.0", "python": "3.11.7"}
EXPECTED = {("chief", 0): "h:1", ("ps", 0): "h:2", ("worker", 0): "h:3", ("worker", 1): "h:4"}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.cluster  # runs protoc in a process
def test_generated_code_matches_the_proto():
    for name, text in generated_files().items():
        assert (ROOT / "cluster" / "control" / "proto" / name).read_text() == text, (
            f"run python -m cluster.control.proto.generate ({name})"
        )


@pytest.mark.pure
def test_status_round_trips_through_protobuf():
    registry = Registry(EXPECTED, VERSIONS, heartbeat_timeout=5, total_steps=10, clock=Clock())
    registry.register(("worker", 1), "box", "h:4", 42, VERSIONS, ["CPU:0"])
    status = registry.status()
    wire = pb.StatusReply.FromString(status_message(status).SerializeToString())
    assert status_dict(wire) == status


@pytest.mark.pure
def test_version_skew_is_refused_with_the_reason():
    registry = Registry(EXPECTED, VERSIONS, heartbeat_timeout=5)
    accepted, reason = registry.register(("worker", 0), "box", "h:3", 7, {**VERSIONS, "tensorflow": "2.20.0"}, [])
    assert not accepted
    assert reason == "worker:0 runs tensorflow 2.20.0 (chief has 2.21.0); install the chief's versions on box"


@pytest.mark.pure
def test_duplicate_slot_is_refused_until_the_first_is_lost():
    clock = Clock()
    registry = Registry(EXPECTED, VERSIONS, heartbeat_timeout=5, clock=clock)
    assert registry.register(("worker", 1), "a", "h:4", 1, VERSIONS, []) == (True, "")
    accepted, reason = registry.register(("worker", 1), "b", "h:4", 2, VERSIONS, [])
    assert not accepted and "already registered by pid 1 on a" in reason
    clock.now += 6  # the first one went silent past the timeout: a restarted task may take the slot
    assert registry.register(("worker", 1), "b", "h:4", 2, VERSIONS, []) == (True, "")


@pytest.mark.pure
def test_unknown_slot_and_missing_tasks():
    registry = Registry(EXPECTED, VERSIONS, heartbeat_timeout=5)
    accepted, reason = registry.register(("worker", 5), "a", "h:9", 1, VERSIONS, [])
    assert not accepted and reason.startswith("worker:5 is not in this cluster (2 worker tasks)")
    registry.register(("ps", 0), "a", "h:2", 1, VERSIONS, [])
    assert [(str(task), address) for task, address in registry.missing()] == [
        ("chief:0", "h:1"),
        ("worker:0", "h:3"),
        ("worker:1", "h:4"),
    ]


@pytest.mark.pure
def test_silent_task_is_lost_and_chief_reports_progress():
    clock = Clock()
    registry = Registry(EXPECTED, VERSIONS, heartbeat_timeout=5, clock=clock)
    for key, address in EXPECTED.items():
        registry.register(key, "a", address, 1, VERSIONS, [])
    registry.heartbeat(("chief", 0), "training", {}, 10, {0: 10, 1: 9})
    clock.now += 2
    registry.heartbeat(("chief", 0), "training", {}, 30, {0: 30, 1: 29})
    clock.now += 4  # worker:1 never heartbeated: 6 s since registration
    rows = {row["task"]: row for row in registry.status()["tasks"]}
    assert rows["worker:1"]["state"] == "lost" and rows["worker:1"]["gradients"] == 29
    assert rows["chief:0"]["state"] == "training" and rows["chief:0"]["steps_per_s"] == 10.0


@pytest.fixture
def control_plane():
    registry = Registry(EXPECTED, local_versions(), heartbeat_timeout=5)
    stops: list[str] = []
    servicer = ControlService(registry, 1.0, stops.append, lambda hosts: ({}, []))
    server, port = serve(servicer, "127.0.0.1:0", Credentials("right-token"))
    yield f"127.0.0.1:{port}", registry, stops
    server.stop(grace=0)


@pytest.mark.pure
def test_wrong_token_is_refused_and_changes_nothing(control_plane):
    address, registry, stops = control_plane
    for token in ("wrong-token", ""):
        with pytest.raises(grpc.RpcError) as error:
            stub(address, Credentials(token)).Stop(pb.StopRequest(), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stops == [] and not registry.stopping
    good = stub(address, Credentials("right-token"))
    good.Stop(pb.StopRequest(reason="test"), timeout=5)
    assert stops == ["test from 127.0.0.1"], "the reason names where the call came from"


@pytest.mark.pure
def test_registration_over_grpc_refuses_skew(control_plane):
    address, registry, _ = control_plane
    request = pb.RegisterRequest(
        task=pb.TaskId(type="worker", index=0), host="box", address="h:3", pid=5, versions=pb.Versions(pstrain="0.0.1")
    )
    reply = stub(address, Credentials("right-token")).Register(request, timeout=5)
    assert not reply.accepted and "pstrain 0.0.1" in reply.reason
    assert ("worker", 0) not in registry.tasks


STEPS = 1000


def listening_here(pids: set[int]) -> list[tuple[str, int]]:
    """The listening TCP sockets of `pids` as this (the user's) network namespace sees them: its own
    /proc/net tables matched to the sockets the processes hold (what `ss -ltnp` shows for them)."""
    table = {**parse_table(Path("/proc/self/net/tcp").read_text()), **parse_table(Path("/proc/self/net/tcp6").read_text())}
    held = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    held.add(int(target[8:-1]))
    return [table[inode] for inode in held if inode in table]


def status_json(control: str, token_file: Path) -> subprocess.CompletedProcess:
    argv = PSTRAIN + ["status", "--chief", control, "--token-file", str(token_file), "--json"]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.cluster
def test_live_status_wrong_token_and_lost_worker(tmp_path):
    """A real local cluster: status shows every task; a wrong token is refused while training goes on;
    a worker that stops heartbeating (SIGSTOP) is lost once silent past the timeout, and being a task
    of this machine it is then killed and restarted while the run goes on to the end."""
    run_dir = tmp_path / "run"
    config = tmp_path / "c.toml"
    config.write_text("[cluster]\nheartbeat_interval = 0.5\nheartbeat_timeout = 2.0\n")
    token_file = run_dir / "control.token"
    # Steps enough to outlast the status calls below (each a process) where the cores are idle: 300 ended first.
    args = [
        "launch",
        "--config",
        str(config),
        "--run-dir",
        str(run_dir),
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        "20",
    ]
    seen: dict = {}

    def drive() -> bool:
        log = run_dir / "logs" / "chief-0.log"
        if not log.exists() or "step " not in log.read_text():
            return False
        control = json.loads((run_dir / "cluster.json").read_text())["control"]
        if "serving" not in seen:
            status = json.loads(status_json(control, token_file).stdout)
            if status["state"] != "training" or status["step"] < 30:
                return False
            seen["serving"] = {row["task"]: row["state"] for row in status["tasks"]}
            pids = [row["pid"] for row in status["tasks"]]
            # Where the doors are while it trains: no socket of any task in this (the user's) namespace,
            # every TF server listening in the run's private one (seen through /proc/PID/net).
            run = {*pids, read_holder(RunDir(run_dir)).pid}  # the tasks and the launcher (the run dir lock's holder)
            seen["host_view"] = listening_here(run)
            seen["inside"] = {(x.pid, x.private) for x in listeners(pids)}
            seen["tasks_pids"] = set(pids)
            seen["doctor"] = [(c.level, c.message) for c in run_doors(RunDir(run_dir))]
            bad = tmp_path / "bad.token"
            bad.write_text("not-the-token\n")
            seen["refused"] = status_json(control, bad)
            after = status_json(control, token_file)
            assert after.returncode == 0, after.stderr
            seen["step_after_refusal"] = json.loads(after.stdout)["step"]
            seen["pid"] = next(row["pid"] for row in status["tasks"] if row["task"] == "worker:1")
            psutil.Process(seen["pid"]).send_signal(signal.SIGSTOP)
            # When the launcher last heard it (no later than this: its registry's age of that heartbeat,
            # counted back from before the call), so its silence is measured on the launcher's own clock.
            asked = time.monotonic()
            age = next(row["heartbeat_age_s"] for row in live_status()["tasks"] if row["task"] == "worker:1")
            seen["last_heard"] = asked - age - 0.001  # (the age is rounded to ms)
            return False
        if "silent_for" not in seen and not psutil.pid_exists(seen["pid"]):  # the event: the launcher killed it
            seen["silent_for"] = time.monotonic() - seen["last_heard"]  # at least its silence when it was killed
            seen["others"] = {row["task"]: row["state"] for row in live_status()["tasks"] if row["task"] != "worker:1"}
        return False

    def control_of(run_dir) -> str:
        return json.loads((run_dir / "cluster.json").read_text())["control"]

    def live_status() -> dict:
        """Polled in-process (real gRPC, no interpreter start-up per poll)."""
        control = json.loads((run_dir / "cluster.json").read_text())["control"]
        reply = stub(control, Credentials(token_file.read_text().strip())).Status(pb.StatusRequest(), timeout=5)
        return status_dict(reply)

    result = run_pstrain(args, signal_when=drive)
    assert seen["serving"] == {"chief:0": "training", "ps:0": "serving", "worker:0": "serving", "worker:1": "serving"}
    assert seen["host_view"] == [], "a process of a local cluster listens on TCP in the user's network namespace"
    assert seen["inside"] == {(pid, True) for pid in seen["tasks_pids"]}, "each TF server listens, in the private namespace"
    assert control_of(run_dir).startswith("unix:"), "status and stop went through the run dir's socket"
    listed = [m for _, m in seen["doctor"] if "listens on" in m]
    assert len(listed) == 4 and all("reached by the run's own tasks only" in m for m in listed), seen["doctor"]
    assert {level for level, _ in seen["doctor"]} == {"INFO"}, "doctor --run-dir: no door open to anyone"
    refused = seen["refused"]
    assert refused.returncode == 2 and "refused the token" in refused.stderr and "Traceback" not in refused.stderr
    assert seen["step_after_refusal"] >= 30, "training went on after the refused call"
    # Killed (the event, awaited while the run went on) only once silent past the 2 s timeout, its silence
    # counted from the heartbeat the launcher last heard, never earlier; and while the run went on: the
    # launcher's warning comes before the run's done line. No bound on how long the launcher took.
    assert seen.get("silent_for") is not None and seen["silent_for"] >= 2.0, seen
    warning = "pstrain: warning: " + lost_worker_warning("worker-1 sent no heartbeat for 2s (hung?) and was killed")
    assert warning in result.output and result.output.index(warning) < result.output.index("pstrain: done"), result.output
    assert seen["others"]["worker:0"] == "serving"
    assert result.returncode == 0, result.output
    steps, _ = metrics(run_dir)
    assert [s["step"] for s in steps] == list(range(STEPS)) and all(s["aggregated"] == 2 for s in steps)
    assert_no_orphans(result)
