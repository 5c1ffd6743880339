"""`pstrain node`: run this machine's share of a cluster whose chief runs elsewhere.

The tasks come from the shared cluster config (those whose host is one of this machine's
addresses), or, given only `--chief HOST:PORT`, from the chief's Assignment call. Each task's agent
registers with the chief; the node ends when its tasks end, which they do when the chief says stop
or has been unreachable past the heartbeat timeout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import grpc

from cluster.config import ClusterConfig, Config, ConfigError, TrainConfig, is_local_host, parse_address
from cluster.control.proto import control_pb2 as pb
from cluster.control.security import Credentials
from cluster.control.service import RPC_TIMEOUT_S, stub
from cluster.errors import returncode_exit_code
from cluster.launch.closing import node_rules
from cluster.launch.hosts import local_addresses
from cluster.launch.launcher import control_env
from cluster.launch.supervisor import Supervisor, python_module
from cluster.stop import StopTrap
from cluster.task_setup import task_setup


def tasks_from_config(cluster: ClusterConfig, local: frozenset[str]) -> list[tuple[str, int]]:
    tasks = []
    for kind, addresses in (("ps", cluster.ps), ("worker", cluster.workers)):
        for index, address in enumerate(addresses):
            host, port = parse_address(f"cluster.{kind}", address)
            if is_local_host(host, local):
                if port == 0:
                    raise ConfigError(f"cluster.{kind}s[{index}]: a task on a second machine needs a fixed port")
                tasks.append((kind, index))
    return tasks


def cluster_from_assignment(control: str, creds: Credentials, local: frozenset[str], timeout: float):
    """Ask the chief which tasks this machine runs; retries until the chief answers or `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = stub(control, creds).Assignment(pb.AssignmentRequest(host_addresses=sorted(local)), timeout=RPC_TIMEOUT_S)
            break
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise ConfigError(f"--chief: {control} refused our token; use the cluster's token") from None
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"--chief: no control plane answers at {control} ({e.code().name}); check the address"
                ) from None
            time.sleep(1)
    spec = json.loads(reply.cluster_json)
    gpus = {(t.type, t.index): g for t, g in zip(reply.tasks, reply.worker_gpus, strict=True)}
    cluster = ClusterConfig(
        chief=spec["chief"][0],
        ps=tuple(spec["ps"]),
        workers=tuple(spec["worker"]),
        worker_gpus=tuple(None if gpus.get(("worker", i), -1) < 0 else gpus[("worker", i)] for i in range(len(spec["worker"]))),
        control=control,
    )
    return cluster, [(t.type, t.index) for t in reply.tasks]


def node_env(config: Config | None, cluster: ClusterConfig, creds: Credentials) -> dict[str, str]:
    """What this node hands its tasks: the launcher's `control_env` for the shared `config` (given
    only --chief, `cluster` from the chief's Assignment and the default [train] settings)."""
    return control_env(Config(cluster, config.train if config else TrainConfig()), creds)


def run_node(
    cluster: ClusterConfig, tasks: list[tuple[str, int]], env: dict[str, str], log_dir: Path, where: str = "node"
) -> int:
    """Run `tasks` with the control plane's `env` (`node_env`) until they all exit (0, or the
    first non-zero code) or a stop signal (128+N); their TF ports closed to all but the cluster's
    hosts meanwhile (`where`: "node" refuses where they cannot be, "slurm" says so)."""
    if not tasks:
        raise ConfigError("cluster: no task of this cluster is assigned to this machine; check the hosts in the config")
    log_dir.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(log_dir)
    ports = [parse_address("task", task_setup(cluster, kind, index).address)[1] for kind, index in tasks]
    with StopTrap() as stop, node_rules(cluster, ports, where) as (line, is_open):
        print(f"pstrain node: {'warning: ' if is_open else ''}{line}", file=sys.stderr if is_open else sys.stdout, flush=True)
        try:
            children = [
                supervisor.start(task_setup(cluster, kind, index), python_module("worker"), extra_env=env)
                for kind, index in tasks
            ]
            names = ", ".join(f"{c.task.log_name} at {c.setup.address}" for c in children)
            print(f"pstrain node: running {names}; chief control plane {cluster.control}; logs in {log_dir}", flush=True)
            while not stop.requested and any(c.process.poll() is None for c in children):
                time.sleep(0.2)
            if stop.requested:
                return stop.exit_code
            codes = [returncode_exit_code(c.process.returncode) for c in children]
            for child, code in zip(children, codes, strict=True):
                print(f"pstrain node: {child.task.log_name} exited with code {code} (see {child.log_path})", flush=True)
            return next((c for c in codes if c), 0)
        finally:
            supervisor.stop_all()


def node_cluster(config_cluster: ClusterConfig | None, chief: str | None, creds: Credentials, timeout: float):
    local = local_addresses()
    if chief:
        parse_address("--chief", chief)
        return cluster_from_assignment(chief, creds, local, timeout)
    assert config_cluster is not None
    if parse_address("cluster.control", config_cluster.control)[1] == 0:
        raise ConfigError('cluster.control: a multi-machine cluster needs a fixed control port (e.g. "10.0.0.1:7000")')
    return config_cluster, tasks_from_config(config_cluster, local)
