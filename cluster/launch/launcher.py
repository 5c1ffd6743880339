"""`pstrain launch`: serve the control plane, start this machine's ps and worker servers, wait for
every task of the cluster to register, run the chief, and reap everything."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from cluster import rundir
from cluster.config import ClusterConfig, Config, is_local_host, parse_address
from cluster.control.agent import CONTROL_ENV, INTERVAL_ENV, TIMEOUT_ENV
from cluster.control.registry import Registry
from cluster.control.security import Credentials, load_token
from cluster.control.service import ControlPlane, serve
from cluster.errors import EXIT_RESTARTABLE, returncode_exit_code
from cluster.launch.hosts import local_addresses
from cluster.launch.ports import assign_ports
from cluster.launch.supervisor import Child, Supervisor, python_module
from cluster.plan import TaskPlan, cluster_spec, plan_servers, plan_task
from cluster.versions import local_versions

CHIEF_STOP_GRACE_S = 8.0  # time for the chief to checkpoint after a stop signal before it is killed


def credentials(cluster: ClusterConfig, generate: bool) -> Credentials:
    return Credentials(load_token(cluster.token_file, generate=generate), cluster.tls_cert, cluster.tls_key, cluster.tls_ca)


def control_env(cluster: ClusterConfig, creds: Credentials) -> dict[str, str]:
    """What a task needs to find and authenticate to the control plane."""
    return {
        CONTROL_ENV: cluster.control,
        INTERVAL_ENV: str(cluster.heartbeat_interval),
        TIMEOUT_ENV: str(cluster.heartbeat_timeout),
        **creds.env(),
    }


def expected_tasks(cluster: ClusterConfig) -> dict[tuple[str, int], str]:
    spec = cluster_spec(cluster)
    return {(kind, i): address for kind, addresses in spec.items() for i, address in enumerate(addresses)}


def assignment_for(cluster: ClusterConfig, registry: Registry):
    """The Assignment RPC: unregistered tasks whose host is one of the asker's addresses."""

    def assign(host_addresses: list[str]):
        hosts = set(host_addresses)
        tasks = []
        for (kind, index), address in expected_tasks(cluster).items():
            if kind != "chief" and parse_address("task", address)[0] in hosts and (kind, index) not in registry.tasks:
                gpu = cluster.worker_gpus[index] if kind == "worker" else None
                tasks.append((kind, index, -1 if gpu is None else gpu))
        return cluster_spec(cluster), tasks

    return assign


def describe_not_ready(child: Child) -> str:
    code = child.process.poll()
    state = "not registered" if code is None else f"exited with code {returncode_exit_code(code)}"
    return f"{child.name} at {child.plan.address} ({state}; see {child.log_path})"


def launch(config: Config, local_tasks: set[tuple[str, int]] | None = None, control_bind: str = "") -> int:
    """Run the chief's side of a cluster; returns the chief's exit code.

    `local_tasks`: the (type, index) of the ps/workers to start here (default: those whose host is
    one of this machine's addresses); `control_bind`: where the control plane listens (default
    `cluster.control`), e.g. "0.0.0.0:PORT" where the chief's name does not resolve to itself.
    """
    train = config.train
    local = local_addresses()
    cluster = assign_ports(config.cluster, local)
    creds = credentials(cluster, generate=True)
    run_dir = Path(train.run_dir)
    rundir.prepare(run_dir, rundir.describe("cluster", train, cluster), train)
    token_hint = cluster.token_file
    if not cluster.token_file and "PSTRAIN_TOKEN" not in os.environ:
        token_hint = str(run_dir / "control.token")
        rundir.write_secret(Path(token_hint), creds.token)

    supervisor = Supervisor(run_dir / "logs")
    stop_signal: list[int] = []
    registry = Registry(expected_tasks(cluster), local_versions(), cluster.heartbeat_timeout, total_steps=train.steps)

    def on_stop(reason: str) -> None:
        print(f"pstrain: stopping: {reason}", file=sys.stderr, flush=True)
        registry.request_stop()
        stop_signal.append(signal.SIGTERM)

    def on_signal(signum, _frame):
        stop_signal.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = None
    try:
        servicer = ControlPlane(registry, cluster.heartbeat_interval, on_stop, assignment_for(cluster, registry))
        try:
            server, _ = serve(servicer, control_bind or cluster.control, creds)
        except (OSError, RuntimeError) as e:
            print(f"pstrain: error: cluster.control: cannot serve on {cluster.control} ({e}); pick another port", file=sys.stderr)
            return 2
        print(
            f"pstrain: control plane at {cluster.control}; see it with: pstrain status --chief {cluster.control}"
            + (f" --token-file {token_hint}" if token_hint else ""),
            flush=True,
        )
        env = control_env(cluster, creds)
        here = [p for p in plan_servers(cluster) if runs_here(p, local, local_tasks)]
        servers = [supervisor.start(plan, python_module("worker"), extra_env=env) for plan in here]
        remote = len(cluster.ps) + len(cluster.workers) - len(here)
        print(
            f"pstrain: {len(here)} local tasks starting"
            + (f", waiting for {remote} on other machines" if remote else "")
            + f"; logs in {run_dir / 'logs'}",
            flush=True,
        )
        failure = wait_registered(registry, servers, train.startup_timeout, stop_signal)
        if stop_signal:
            return 128 + stop_signal[0]
        if failure:
            print(f"pstrain: error: {failure}", file=sys.stderr)
            return 1
        chief_env = {**env, "PSTRAIN_TTY": "1" if sys.stdout.isatty() else "0"}
        chief = supervisor.start(
            plan_task(cluster, "chief", 0), python_module("chief", "--run-dir", str(run_dir)), sys.stdout.buffer, chief_env
        )
        return Supervision(supervisor, registry, cluster, train.startup_timeout, stop_signal).run(chief)
    finally:
        registry.shutdown()
        supervisor.stop_all()
        if server is not None:
            linger_for_remote_nodes(registry, cluster, local)
            server.stop(grace=1)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def runs_here(plan: TaskPlan, local: frozenset[str], local_tasks: set[tuple[str, int]] | None) -> bool:
    if local_tasks is not None:
        return (plan.type, plan.index) in local_tasks
    return is_local_host(parse_address("task", plan.address)[0], local)


def wait_registered(registry: Registry, servers: list[Child], timeout: float, stop_signal) -> str:
    """Wait until every ps and worker registered; returns an error message, or "" on success."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop_signal:
        missing = [(name, address) for name, address in registry.missing() if not name.startswith("chief")]
        if not missing:
            return ""
        dead = next((c for c in servers if c.process.poll() is not None), None)
        if dead:
            return f"task not ready: {describe_not_ready(dead)}"
        time.sleep(0.2)
    if stop_signal:
        return ""
    missing = [(name, address) for name, address in registry.missing() if not name.startswith("chief")]
    local = {c.plan.name.replace("-", ":"): c for c in servers}
    details = ", ".join(describe_not_ready(local[n]) if n in local else f"{n} expected at {a}" for n, a in missing)
    return f"tasks not registered after {timeout:g}s: {details}"


class Supervision:
    """Watch a running cluster: restart crashed tasks (bounded, with back-off), restart the chief
    after a ps loss so it resumes from its checkpoint, and end the run when a task stays lost."""

    def __init__(self, supervisor: Supervisor, registry: Registry, cluster: ClusterConfig, startup_timeout: float, stop_signal):
        self.supervisor, self.registry, self.cluster = supervisor, registry, cluster
        self.startup_timeout, self.stop_signal = startup_timeout, stop_signal
        self.failure = ""

    def run(self, chief: Child) -> int:
        while True:
            code = self._watch(chief)
            if self.failure:
                print(f"pstrain: error: {self.failure}", file=sys.stderr, flush=True)
                return 1
            if self.stop_signal:
                return 128 + self.stop_signal[0] if code else 0
            if code != EXIT_RESTARTABLE or chief.restarts >= self.cluster.max_restarts:
                return code
            self._restart_dead_servers(wait=True)
            failure = wait_registered(self.registry, self._servers(), self.startup_timeout, self.stop_signal)
            if failure:
                print(f"pstrain: error: {failure}", file=sys.stderr, flush=True)
                return 1
            print(
                f"pstrain: restarting the chief to resume from its checkpoint ({chief.restarts + 1}/{self.cluster.max_restarts})",
                flush=True,
            )
            self.registry.forget(("chief", 0))
            chief = self.supervisor.restart(chief)

    def _servers(self) -> list[Child]:
        return [c for c in self.supervisor.children if c.plan.type != "chief"]

    def _watch(self, chief: Child) -> int:
        forwarded, deadline = False, 0.0
        while chief.process.poll() is None:
            if (self.stop_signal or self.failure) and not forwarded:
                chief.process.send_signal(self.stop_signal[0] if self.stop_signal else signal.SIGTERM)
                forwarded, deadline = True, time.monotonic() + CHIEF_STOP_GRACE_S
            if forwarded and time.monotonic() > deadline:
                chief.process.kill()
            if not forwarded:
                self._restart_dead_servers(wait=False)
                self._check_lost()
            time.sleep(0.1)
        self.supervisor.reap(chief)
        return returncode_exit_code(chief.process.returncode)

    def _restart_dead_servers(self, wait: bool) -> None:
        for child in self._servers():
            code = child.process.poll()
            if code is None:
                continue
            if child.restarts >= self.cluster.max_restarts:
                if not self.failure:
                    times = f"{child.restarts + 1} times"
                    self.failure = (
                        f"{child.name} exited with code {returncode_exit_code(code)} {times}; giving up (see {child.log_path})"
                    )
                continue
            delay = min(2.0**child.restarts, 8.0)
            print(
                f"pstrain: {child.name} exited with code {returncode_exit_code(code)}; restarting in {delay:g}s "
                f"({child.restarts + 1}/{self.cluster.max_restarts}, see {child.log_path})",
                file=sys.stderr,
                flush=True,
            )
            self.registry.forget((child.plan.type, child.plan.index))
            time.sleep(delay)
            self.supervisor.restart(child)

    def _check_lost(self) -> None:
        """A task silent past the heartbeat timeout ends the run (after a checkpoint)."""
        local_dead = {c.plan.name.replace("-", ":") for c in self._servers() if c.process.poll() is not None}
        lost = [(name, r) for name, r in self.registry.lost() if name not in local_dead and not name.startswith("chief")]
        if lost and not self.failure:
            names = ", ".join(f"{name} at {record.address}" for name, record in lost)
            self.failure = (
                f"lost {names}: no heartbeat for {self.cluster.heartbeat_timeout:g}s (network cut or hung task?); "
                "stopped with a checkpoint, run the same command again to resume"
            )


def linger_for_remote_nodes(registry: Registry, cluster: ClusterConfig, local: frozenset[str]) -> None:
    """Keep answering heartbeats briefly so tasks on other machines hear "stop" and exit."""
    hosts = [parse_address("task", record.address)[0] for record in registry.tasks.values()]
    if any(not is_local_host(host, local) for host in hosts):
        time.sleep(min(2 * cluster.heartbeat_interval + 0.5, 10.0))
