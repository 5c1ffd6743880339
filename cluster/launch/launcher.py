"""`pstrain launch`: serve the control plane, start this machine's ps and worker servers, wait for
every task of the cluster to register, run the chief under a `ClusterWatch` (cluster/launch/watch.py),
and reap everything."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from dataclasses import replace

from cluster import rundir
from cluster.config import ClusterConfig, Config, is_local_host, parse_address
from cluster.control.registry import Registry
from cluster.control.security import Credentials, load_token
from cluster.control.service import ControlService, serve
from cluster.errors import ConfigError, PstrainError, writing
from cluster.launch.closing import closed
from cluster.launch.console import say, say_stopped
from cluster.launch.hosts import local_addresses
from cluster.launch.ports import assign_ports
from cluster.launch.supervisor import Child, Supervisor, python_module
from cluster.launch.watch import ClusterWatch, wait_registered
from cluster.preflight import check_writable
from cluster.rundir import latest_checkpoint_step
from cluster.runlock import RunDirLock
from cluster.stop import StopTrap
from cluster.task import TaskId
from cluster.task_setup import TaskSetup, cluster_spec, gpu_line, gpu_sharers, server_setups, task_setup
from cluster.taskenv import TaskEnv, token_in_env
from cluster.versions import local_versions


def credentials(cluster: ClusterConfig, generate: bool) -> Credentials:
    return Credentials(load_token(cluster.token_file, generate=generate), cluster.tls_cert, cluster.tls_key, cluster.tls_ca)


def control_env(config: Config, creds: Credentials) -> dict[str, str]:
    """What every path (launch, node, Slurm, pod) hands a ps or worker of `config`: where the control
    plane is, how to authenticate to it, the heartbeat settings and the registration timeout."""
    return TaskEnv.for_config(config, creds.token, creds.trusted_ca).to_env()


def shared_control_env(config: Config) -> dict[str, str]:
    """`control_env` for tasks started away from the launcher (a Slurm node, a TFJob pod): the cluster's
    shared token (token_file or $PSTRAIN_TOKEN; none is generated) and its TLS CA."""
    return control_env(config, credentials(config.cluster, generate=False))


def expected_tasks(cluster: ClusterConfig) -> dict[TaskId, str]:
    spec = cluster_spec(cluster)
    return {TaskId(kind, i): address for kind, addresses in spec.items() for i, address in enumerate(addresses)}


def assignment_for(cluster: ClusterConfig, registry: Registry):
    """The Assignment RPC: unregistered tasks whose host is one of the asker's addresses."""

    def assign(host_addresses: list[str]):
        hosts = set(host_addresses)
        tasks = []
        for task, address in expected_tasks(cluster).items():
            if not task.is_chief and parse_address("task", address)[0] in hosts and task not in registry.tasks:
                gpu = cluster.worker_gpus[task.index] if task.type == "worker" else None
                tasks.append((task.type, task.index, -1 if gpu is None else gpu))
        return cluster_spec(cluster), tasks

    return assign


def token_hint(cluster: ClusterConfig, run_dir: rundir.RunDir, creds: Credentials) -> str:
    """Where `pstrain status` finds the token; a generated token is written to RUN_DIR/control.token."""
    if cluster.token_file or token_in_env():
        return cluster.token_file
    path = run_dir.control_token
    rundir.write_secret(path, creds.token)
    return str(path)


ENGINE_OF = {"slurm": "slurm", "pod": "tfjob"}  # control.json's engine by who launches (else cluster.engine)


def client_target(control: str) -> str:
    """`control` as a client in another directory calls it: a relative `unix:` socket path made absolute. Pure
    but for the working directory."""
    if control.startswith("unix:") and not control.startswith(("unix:/", "unix://")):
        return "unix:" + os.path.abspath(control.removeprefix("unix:"))
    return control


def control_record(
    cluster: ClusterConfig, run_dir: rundir.RunDir, token_file: str, creds: Credentials, engine: str
) -> rundir.ControlRecord:
    """control.json of this launch: where a client calls (`client_target`), the token's file (the run
    dir's own by its name there, another one absolute; "" for $PSTRAIN_TOKEN) and the CA, absolute."""
    own = token_file == str(run_dir.control_token)
    token = (os.path.relpath(token_file, run_dir.path) if own else os.path.abspath(token_file)) if token_file else ""
    ca = os.path.abspath(creds.trusted_ca) if creds.trusted_ca else ""
    return rundir.ControlRecord(client_target(cluster.control), engine, token, ca, socket.gethostname(), os.getpid())


def launch(
    config: Config,
    layout: rundir.RunDir,
    local_tasks: set[tuple[str, int]] | None = None,
    control_bind: str = "",
    where: str = "launch",
) -> int:
    """Run the chief's side of a cluster in `layout` (the RunDir of `config.train.run_dir`, made by the
    entry point); returns the exit code (the chief's, or 128+N after signal N).

    `local_tasks`: the (type, index) of the ps/workers to start here (default: those whose host is
    one of this machine's addresses); `control_bind`: where the control plane listens (default
    `cluster.control`), e.g. "0.0.0.0:PORT" where the chief's name does not resolve to itself;
    `where`: who launches ("launch", "slurm", "pod"): how the TF ports are closed (cluster/launch/closing.py).
    """
    local = local_addresses()
    cluster = assign_ports(config.cluster, local)
    creds = credentials(cluster, generate=True)
    check_writable(layout)  # before any task starts
    rundir.check_earlier_run(layout, config.train)  # before the namespace's maker or any task starts
    # The stop trap first: a Ctrl-C from here on is a stop said in one line, not a KeyboardInterrupt.
    with StopTrap() as stop, RunDirLock(layout, "pstrain launch") as lock:  # before anything is written there
        with closed(cluster, local_tasks, lock.run_dir, ports_here(cluster, local, local_tasks), where) as doors:
            say(doors.line, warning=doors.open)
            supervisor = Supervisor(lock.layout.logs, doors.network)
            return launch_locked(
                config, doors.cluster, creds, lock, local, local_tasks, control_bind, stop, supervisor, ENGINE_OF.get(where, "")
            )


def launch_locked(
    config: Config,
    cluster: ClusterConfig,
    creds: Credentials,
    lock: RunDirLock,
    local: frozenset[str],
    local_tasks,
    control_bind: str,
    stop: StopTrap,
    supervisor: Supervisor | None = None,
    engine: str = "",
) -> int:
    """`launch` once the run dir is locked, under the caller's `stop` trap; `supervisor` starts the
    tasks (default: processes here; the Ray engine's starts them in Ray actors on the nodes Ray chose)."""
    train, run_dir, layout = config.train, lock.run_dir, lock.layout
    with writing(run_dir):
        rundir.prepare(layout, rundir.describe("cluster", train, cluster), train)
        hint = token_hint(cluster, lock.layout, creds)
        lock.layout.stop_cause.unlink(missing_ok=True)  # a killed launch's
    supervisor = supervisor or Supervisor(lock.layout.logs)
    registry = Registry(
        expected_tasks(cluster),
        local_versions(),
        cluster.heartbeat_timeout,
        total_steps=0 if train.epochs else train.steps,  # by epochs: the chief learns the steps from the data
        max_restarts=cluster.max_restarts,
        restart_window=cluster.restart_window,
    )
    server, record = None, None
    try:
        server = serve_control_plane(cluster, registry, creds, stop, control_bind)
        record = control_record(cluster, lock.layout, hint, creds, engine or cluster.engine)
        with writing(run_dir):
            rundir.write_control(layout, record)  # `pstrain status|stop|doctor --run-dir` read it
            lock.set_control(str(run_dir.absolute()))  # the refusal's `pstrain stop --run-dir`, from anywhere
        say(f"control plane at {cluster.control}; watch it with: pstrain status --run-dir {run_dir}")
        env = control_env(replace(config, cluster=cluster), creds)
        servers = start_local_servers(supervisor, cluster, local, env, local_tasks)
        # The chief starts with the servers: it imports TensorFlow and loads the job while they
        # start, and connects once the ready file says every one of them registered.
        ready = lock.layout.logs / f"cluster-ready-{os.getpid()}"
        ready.unlink(missing_ok=True)
        chief_env = {**env, **TaskEnv(ready_file=str(ready), tty=sys.stdout.isatty()).to_env()}
        chief_argv = python_module("chief", "--run-dir", str(run_dir))
        chief = supervisor.start(task_setup(cluster, "chief", 0), chief_argv, sys.stdout.buffer, chief_env)
        try:
            failure = wait_registered(registry, servers, train.startup_timeout, stop, chief)
            if stop.requested:
                return say_stopped(stop, latest_checkpoint_step(layout), "start-up")
            if failure:
                raise PstrainError(failure)
            ready.touch()
            return ClusterWatch(supervisor, registry, cluster, train.startup_timeout, stop, layout, train.dense).run(chief)
        finally:
            ready.unlink(missing_ok=True)
    finally:
        registry.shutdown()
        supervisor.stop_all()
        if server is not None:
            linger_for_remote_nodes(registry, cluster, local)
            server.stop(grace=1)
        if record is not None:
            rundir.remove_control(layout, record)
        with contextlib.suppress(OSError):
            lock.layout.stop_cause.unlink(missing_ok=True)


def serve_control_plane(cluster: ClusterConfig, registry: Registry, creds: Credentials, stop: StopTrap, bind: str = ""):
    """Serve pstrain's control plane; `pstrain stop` makes the chief checkpoint, then everything exits."""

    def on_stop(reason: str) -> None:
        say(f"stopping: {reason} asked the chief to checkpoint at the next step")
        registry.request_stop(reason)
        stop.request(signal.SIGTERM, cause=reason)

    servicer = ControlService(registry, cluster.heartbeat_interval, on_stop, assignment_for(cluster, registry))
    try:
        return serve(servicer, bind or cluster.control, creds)[0]
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"cluster.control: cannot serve on {cluster.control} ({e}); pick another port") from None


def start_local_servers(
    supervisor: Supervisor, cluster: ClusterConfig, local: frozenset[str], env: dict[str, str], local_tasks=None
) -> list[Child]:
    """Start the ps and worker servers that run here; the others register from their own machines."""
    here = [p for p in server_setups(cluster) if runs_here(p, local, local_tasks)]
    beside_chief = {**env, **TaskEnv(start_turns=True).to_env()}  # they load in turns: the chief keeps a core
    servers = [supervisor.start(setup, python_module("worker"), extra_env=beside_chief) for setup in here]
    remote = len(cluster.ps) + len(cluster.workers) - len(here)
    waiting = f", waiting for {remote} on other machines" if remote else ""
    say(f"{local_task_count(here)} starting{waiting}; logs in {supervisor.log_dir}")
    if gpu_sharers(cluster):
        say(f"GPUs: {gpu_line(cluster)}")
    return servers


def local_task_count(servers: list[TaskSetup]) -> str:
    """ "4 local tasks (chief, 1 ps, 2 workers)": the chief (always started here) and `servers`. Pure."""
    counts = {kind: sum(p.task.type == kind for p in servers) for kind in ("ps", "worker")}
    parts = ["chief"] + [f"{n} {kind}{'s' * (n != 1 and kind == 'worker')}" for kind, n in counts.items() if n]
    return f"{len(servers) + 1} local task{'s' * bool(servers)} ({', '.join(parts)})"


def ports_here(cluster: ClusterConfig, local: frozenset[str], local_tasks) -> list[int]:
    """The TF ports of the tasks this launcher runs on this machine: the chief's and its local servers'."""
    setups = [task_setup(cluster, "chief", 0), *(s for s in server_setups(cluster) if runs_here(s, local, local_tasks))]
    return [parse_address("task", setup.address)[1] for setup in setups]


def runs_here(setup: TaskSetup, local: frozenset[str], local_tasks: set[tuple[str, int]] | None) -> bool:
    """A task runs here when `local_tasks` names it, or (by default) when its host is this machine."""
    if local_tasks is not None:
        return setup.task in local_tasks
    return is_local_host(parse_address("task", setup.address)[0], local)


def linger_for_remote_nodes(registry: Registry, cluster: ClusterConfig, local: frozenset[str]) -> None:
    """Keep answering heartbeats briefly so tasks on other machines hear "stop" and exit."""
    hosts = [parse_address("task", record.address)[0] for record in registry.tasks.values()]
    if any(not is_local_host(host, local) for host in hosts):
        time.sleep(min(2 * cluster.heartbeat_interval + 0.5, 10.0))
