"""`pstrain launch --engine ray`: Ray places the tasks, pstrain runs them as `pstrain launch` does.

It joins a Ray cluster (`--address auto|HOST:PORT`) or starts a local one on 127.0.0.1, reserves the
whole cluster at once with one placement group (cluster/launch/ray_placement.py), starts one TaskHost actor
per task in its bundle, builds TF_CONFIG from the address and free port each reports, checks that
every node sees the run dir, and runs the launcher's control plane and ClusterWatch over the actors
(cluster/launch/ray_supervisor.py). A lost node ends that placement: the tasks are placed again and
the chief resumes from its checkpoint. Everything, Ray's own processes of a local Ray included, is
stopped on the way out.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from cluster import rundir
from cluster.config import ClusterConfig, Config, ConfigError, format_address, parse_address, with_train
from cluster.doors import unclosed_line
from cluster.errors import PstrainError
from cluster.launch.hosts import local_addresses
from cluster.launch.launcher import credentials, launch_locked, say, say_stopped
from cluster.launch.ports import free_port
from cluster.launch.ray_host import TaskHost
from cluster.launch.ray_placement import (
    Placed,
    Reservation,
    check_counts_only,
    loopback_address,
    placed_cluster,
    reservation,
    task_resources,
    tasks_of,
    unshared_nodes,
)
from cluster.launch.ray_supervisor import NodeLost, RaySupervisor
from cluster.preflight import check_writable
from cluster.rundir import latest_checkpoint_step
from cluster.runlock import RunDirLock
from cluster.stop import StopTrap
from cluster.task import TaskId

WAIT_SLICE_S = 0.5  # how often a wait for Ray checks for a stop
PROBE_TIMEOUT_S = 3.0  # a TCP connect to --address before Ray's own (which retries for 20 s)
DEFAULT_RAY_TOKEN = Path.home() / ".ray" / "auth_token"  # Ray's token authentication: its default token file


def import_ray(address: str) -> Any:
    """Ray, kept to 127.0.0.1 for a local cluster (no address, or a loopback one); one line if missing."""
    if not address or loopback_address(address):
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's single-machine mode: loopback only
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    token = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    has_token = any(os.environ.get(n) for n in token) or DEFAULT_RAY_TOKEN.exists()
    if address and "RAY_AUTH_MODE" not in os.environ and has_token:
        os.environ["RAY_AUTH_MODE"] = "token"  # as `ray start` does where a token exists; read when Ray loads
    try:
        import ray
    except ImportError:
        raise ConfigError('cluster.engine: "ray" needs Ray; install it with: deploy/install_ray.sh') from None
    return ray


def connect(ray: Any, cluster: ClusterConfig, cpus: int, stop: StopTrap) -> None:
    """Join the Ray cluster at `cluster.ray_address`, or start a local one (loopback, no dashboard,
    `cpus` logical CPUs: one per task) that this driver owns and `ray.shutdown()` stops. `stop`'s
    handlers stay: `ray.init` puts a SIGTERM handler of its own (an abrupt exit) in their place."""
    handlers = stop.handlers()
    try:
        join_or_start(ray, cluster, cpus)
    finally:
        stop.rearm(handlers)


def join_or_start(ray: Any, cluster: ClusterConfig, cpus: int) -> None:
    common = {"log_to_driver": False, "configure_logging": False}
    if cluster.ray_address:
        if cluster.ray_address != "auto":
            check_answers(cluster.ray_address)
        try:
            ray.init(address=cluster.ray_address, **common)
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"--address: no Ray cluster at {cluster.ray_address} ({first}); start one (docs/ray.md)") from None
        return
    from cluster.launch.gpu_count import gpu_count

    ray.init(num_cpus=cpus, num_gpus=gpu_count(), include_dashboard=False, **common)


def check_answers(address: str) -> None:
    """Refuse at once, in one line, an --address where nothing accepts a connection (Ray's own connect
    retries for 20 s and logs every try)."""
    host, port = parse_address("--address", address)
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        why = e.strerror or type(e).__name__.replace("Error", "").lower() or "no answer"
        raise ConfigError(
            f"--address: nothing answers at {address} ({why}); give the Ray head's HOST:PORT "
            f"(`ray start --head --port={port}` prints it), or leave --address out to start a local Ray"
        ) from None


def wait_for(ray: Any, refs: list, timeout: float, stop: StopTrap) -> list | None:
    """ray.get(refs), in slices that notice a stop (None) or time out (TimeoutError)."""
    deadline = time.monotonic() + timeout
    while not stop.requested:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=WAIT_SLICE_S)
        if len(ready) == len(refs):
            return ray.get(refs)
        if time.monotonic() > deadline:
            raise TimeoutError
    return None


def reserve(ray: Any, wanted: Reservation, timeout: float, stop: StopTrap) -> Any:
    """The placement group of the whole cluster, once Ray has reserved every bundle."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(wanted.bundles, strategy=wanted.strategy)
    try:
        if wait_for(ray, [group.ready()], timeout, stop) is None:
            remove_placement_group(group)
            return None
    except TimeoutError:
        remove_placement_group(group)
        raise PstrainError(
            f"ray: cannot reserve {len(wanted.bundles)} bundles {wanted.bundles} ({wanted.strategy}) within {timeout:g}s; "
            f"the cluster has {ray.available_resources()} free (add nodes, or ask fewer tasks)"
        ) from None
    return group


def start_hosts(ray: Any, group: Any, wanted: Reservation, tasks: list[TaskId], gpus: bool, log_dir: Path) -> dict:
    """One TaskHost actor per task, in the task's bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor = ray.remote(TaskHost)
    return {
        task: actor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=wanted.bundle_of[task]),
            max_restarts=0,
            **task_resources(task, gpus),
        ).remote(str(log_dir), os.getcwd(), launcher_env())
        for task in tasks
    }


def launcher_env() -> dict[str, str]:
    """What `pstrain launch` hands every task from its own environment beyond its setup: gRPC's settings."""
    return {name: value for name, value in os.environ.items() if name.startswith("GRPC_")}


def place(ray: Any, hosts: dict, run_dir: rundir.RunDir, timeout: float, stop: StopTrap) -> dict[TaskId, Placed] | None:
    """Where each actor runs; refuses a run dir that a node cannot read (it must be shared)."""
    probe = run_dir.logs / f".ray-shared-{os.getpid()}"
    content = secrets.token_hex(8)
    probe.write_text(content)
    try:
        tasks = list(hosts)
        answers = wait_for(ray, [hosts[t].where.remote() for t in tasks], timeout, stop)
        if answers is None:
            return None
        placed = {t: Placed(host, port, tuple(gpus)) for t, (host, port, gpus) in zip(tasks, answers, strict=True)}
        seen = ray.get([hosts[t].sees.remote(str(probe), content) for t in tasks])
    except TimeoutError:
        raise PstrainError(f"ray: the tasks' actors were not placed within {timeout:g}s; is a node missing?") from None
    finally:
        probe.unlink(missing_ok=True)
    unshared = unshared_nodes({placed[t].host: ok for t, ok in zip(tasks, seen, strict=True)})
    if unshared:
        raise ConfigError(
            f"train.run_dir: {run_dir.path} is not shared with the Ray node(s) {', '.join(unshared)}; "
            "give a path on a file system every node mounts at the same place"
        )
    return placed


def launch_ray(config: Config, layout: rundir.RunDir) -> int:
    """Run the cluster of `config` on Ray in `layout` (the RunDir of `config.train.run_dir`, made by the
    entry point); returns the exit code, as `launch` does."""
    cluster = config.cluster
    check_counts_only(cluster)
    layout = layout.resolved()  # the same path on every node
    config = with_train(config, run_dir=str(layout.path))
    check_writable(layout)  # before Ray places anything, as `launch` checks
    ray = import_ray(cluster.ray_address)
    tasks = tasks_of(cluster)
    with StopTrap() as stop:
        connect(ray, cluster, len(tasks), stop)
        try:
            with RunDirLock(layout, "pstrain launch") as lock:
                return run_placements(ray, config, lock, stop)
        finally:
            ray.shutdown()  # a local Ray that this driver started stops with it


def run_placements(ray: Any, config: Config, lock: RunDirLock, stop: StopTrap) -> int:
    """Reserve the cluster and run it; after a lost node, place it again and resume (at most
    `max_restarts` times)."""
    cluster, train = config.cluster, config.train
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    wanted = reservation(cluster, worker_gpus=gpus)
    group = reserve(ray, wanted, train.startup_timeout, stop)
    if group is None:
        return say_stopped(stop, latest_checkpoint_step(lock.layout), "start-up")
    logs = lock.layout.logs
    logs.mkdir(parents=True, exist_ok=True)
    creds = credentials(cluster, generate=True)
    from ray.util.placement_group import remove_placement_group

    try:
        for placement in range(cluster.max_restarts + 1):
            hosts = start_hosts(ray, group, wanted, tasks_of(cluster), gpus, logs)
            try:
                placed = place(ray, hosts, lock.layout, train.startup_timeout, stop)
                if placed is None:
                    return say_stopped(stop, latest_checkpoint_step(lock.layout), "start-up")
                here = ray.util.get_node_ip_address()
                control = format_address(here, free_port(here))
                ran = placed_cluster(cluster, placed, control)
                say(f"Ray placed {describe(ran)}")
                say(unclosed_line("the tasks run in Ray's worker processes, where pstrain makes no rules"), warning=True)
                local_tasks = {(t.type, t.index) for t in tasks_of(ran) if not t.is_chief}
                supervisor = RaySupervisor(ray, logs, hosts)
                return launch_locked(
                    replace(config, cluster=ran), ran, creds, lock, local_addresses(), local_tasks, control, stop, supervisor
                )
            except NodeLost as lost:
                if placement == cluster.max_restarts or stop.requested:
                    raise PstrainError(f"{lost}; gave up after {placement + 1} placements") from None
                step = latest_checkpoint_step(lock.layout)
                point = f"checkpoint step {step}" if step is not None else "step 0 (no checkpoint yet)"
                wait = f"waiting up to {train.startup_timeout:g}s for room for {len(wanted.bundles)} bundles, {wanted.strategy}"
                line = f"lost {lost.task} at {lost.address} (its Ray node); resuming from {point} once Ray places it again"
                say(f"{line} ({wait})", warning=True)
            finally:
                for host in hosts.values():
                    ray.kill(host)
        return stop.exit_code
    finally:
        remove_placement_group(group)


def describe(cluster: ClusterConfig) -> str:
    """'chief on A, ps on A, workers on A, B' (each host once) for the console."""

    def hosts(addresses) -> str:
        return ", ".join(dict.fromkeys(a.rpartition(":")[0] for a in addresses))

    return f"chief on {hosts([cluster.chief])}, ps on {hosts(cluster.ps)}, workers on {hosts(cluster.workers)}"
