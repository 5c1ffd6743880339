"""`pstrain launch`: serve the control plane, start this machine's ps and worker servers, wait for
every task of the cluster to register, run the chief, and reap everything."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from cluster import rundir
from cluster.config import ClusterConfig, Config, is_local_host, parse_address
from cluster.control.registry import Registry
from cluster.control.security import Credentials, load_token
from cluster.control.service import ControlPlane, serve
from cluster.errors import (
    EXIT_FAILURE,
    EXIT_RESTARTABLE,
    ConfigError,
    PstrainError,
    report,
    returncode_exit_code,
    signal_exit_code,
    writing,
)
from cluster.launch.hosts import local_addresses
from cluster.launch.ports import assign_ports
from cluster.launch.supervisor import Child, Supervisor, python_module
from cluster.plan import TaskPlan, cluster_spec, gpu_line, gpu_sharers, plan_servers, plan_task
from cluster.policy import (
    EndRun,
    Finish,
    GiveUp,
    Kill,
    RestartBudget,
    budget_phrase,
    chief_decision,
    restart_budget,
    restart_decision,
    silent_task_decision,
)
from cluster.preflight import check_writable
from cluster.rundir import checkpoint_progress, latest_checkpoint_step
from cluster.runlock import RunDirLock
from cluster.stop import StopTrap
from cluster.stop_report import stop_outcome
from cluster.task import TaskId
from cluster.taskenv import TaskEnv, token_in_env
from cluster.versions import local_versions

CHIEF_STOP_GRACE_S = 8.0  # a stopped chief is killed after this long without progress in its checkpoint write


def say(text: str, error: bool = False, warning: bool = False) -> None:
    """A launcher line on the console: progress to stdout, problems (errors; warnings of a recovery) to stderr."""
    if error:
        report(text)
        return
    print(f"pstrain: {'warning: ' if warning else ''}{text}", file=sys.stderr if warning else sys.stdout, flush=True)


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


def describe_not_ready(child: Child) -> str:
    code = child.process.poll()
    state = "not registered" if code is None else f"exited with code {returncode_exit_code(code)}"
    return f"{child.task.log_name} at {child.plan.address} ({state}; see {child.log_path})"


def token_hint(cluster: ClusterConfig, run_dir: Path, creds: Credentials) -> str:
    """Where `pstrain status` finds the token; a generated token is written to RUN_DIR/control.token."""
    if cluster.token_file or token_in_env():
        return cluster.token_file
    path = rundir.RunDir(run_dir).control_token
    rundir.write_secret(path, creds.token)
    return str(path)


def launch(config: Config, local_tasks: set[tuple[str, int]] | None = None, control_bind: str = "") -> int:
    """Run the chief's side of a cluster; returns the exit code (the chief's, or 128+N after signal N).

    `local_tasks`: the (type, index) of the ps/workers to start here (default: those whose host is
    one of this machine's addresses); `control_bind`: where the control plane listens (default
    `cluster.control`), e.g. "0.0.0.0:PORT" where the chief's name does not resolve to itself.
    """
    train, local = config.train, local_addresses()
    cluster = assign_ports(config.cluster, local)
    creds = credentials(cluster, generate=True)
    check_writable(Path(train.run_dir))  # before any task starts
    # The stop trap first: a Ctrl-C from here on is a stop said in one line, not a KeyboardInterrupt.
    with StopTrap() as stop, RunDirLock(Path(train.run_dir), "pstrain launch") as lock:  # before anything is written there
        return launch_locked(config, cluster, creds, lock, local, local_tasks, control_bind, stop)


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
) -> int:
    """`launch` once the run dir is locked, under the caller's `stop` trap; `supervisor` starts the
    tasks (default: processes here; the Ray engine's starts them in Ray actors on the nodes Ray chose)."""
    train, run_dir = config.train, lock.run_dir
    with writing(run_dir):
        rundir.prepare(run_dir, rundir.describe("cluster", train, cluster), train)
        lock.set_control(cluster.control)
        hint = token_hint(cluster, run_dir, creds)
    supervisor = supervisor or Supervisor(rundir.RunDir(run_dir).logs)
    registry = Registry(
        expected_tasks(cluster),
        local_versions(),
        cluster.heartbeat_timeout,
        total_steps=train.steps,
        max_restarts=cluster.max_restarts,
        restart_window=cluster.restart_window,
    )
    server = None
    try:
        server = serve_control_plane(cluster, registry, creds, stop, control_bind)
        say(
            f"control plane at {cluster.control}; see it with: pstrain status --chief {cluster.control}"
            + (f" --token-file {hint}" if hint else "")
        )
        env = control_env(replace(config, cluster=cluster), creds)
        servers = start_local_servers(supervisor, cluster, local, env, local_tasks)
        # The chief starts with the servers: it imports TensorFlow and loads the job while they
        # start, and connects once the ready file says every one of them registered.
        ready = rundir.RunDir(run_dir).logs / f"cluster-ready-{os.getpid()}"
        ready.unlink(missing_ok=True)
        chief_env = {**env, **TaskEnv(ready_file=str(ready), tty=sys.stdout.isatty()).to_env()}
        chief_argv = python_module("chief", "--run-dir", str(run_dir))
        chief = supervisor.start(plan_task(cluster, "chief", 0), chief_argv, sys.stdout.buffer, chief_env)
        try:
            failure = wait_registered(registry, servers, train.startup_timeout, stop, chief)
            if stop.requested:
                return say_stopped(stop, latest_checkpoint_step(run_dir), "start-up")
            if failure:
                raise PstrainError(failure)
            ready.touch()
            return Supervision(supervisor, registry, cluster, train.startup_timeout, stop, run_dir).run(chief)
        finally:
            ready.unlink(missing_ok=True)
    finally:
        registry.shutdown()
        supervisor.stop_all()
        if server is not None:
            linger_for_remote_nodes(registry, cluster, local)
            server.stop(grace=1)


def say_stopped(stop: StopTrap, checkpoint: int | None, how: str) -> int:
    """The console line of a stopped run (cluster/stop_report.py); returns its exit code."""
    outcome = stop_outcome(stop.cause, stop.commanded, stop.exit_code, checkpoint, how)
    print(outcome.line, flush=True)
    return outcome.exit_code


def serve_control_plane(cluster: ClusterConfig, registry: Registry, creds: Credentials, stop: StopTrap, bind: str = ""):
    """Serve pstrain's control plane; `pstrain stop` makes the chief checkpoint, then everything exits."""

    def on_stop(reason: str) -> None:
        say(f"stopping: {reason} asked the chief to checkpoint at the next step")
        registry.request_stop()
        stop.request(signal.SIGTERM, cause=reason)

    servicer = ControlPlane(registry, cluster.heartbeat_interval, on_stop, assignment_for(cluster, registry))
    try:
        return serve(servicer, bind or cluster.control, creds)[0]
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"cluster.control: cannot serve on {cluster.control} ({e}); pick another port") from None


def start_local_servers(
    supervisor: Supervisor, cluster: ClusterConfig, local: frozenset[str], env: dict[str, str], local_tasks=None
) -> list[Child]:
    """Start the ps and worker servers that run here; the others register from their own machines."""
    here = [p for p in plan_servers(cluster) if runs_here(p, local, local_tasks)]
    servers = [supervisor.start(plan, python_module("worker"), extra_env=env) for plan in here]
    remote = len(cluster.ps) + len(cluster.workers) - len(here)
    waiting = f", waiting for {remote} on other machines" if remote else ""
    say(f"{len(here)} local tasks starting{waiting}; logs in {supervisor.log_dir}")
    if gpu_sharers(cluster):
        say(f"GPUs: {gpu_line(cluster)}")
    return servers


def runs_here(plan: TaskPlan, local: frozenset[str], local_tasks: set[tuple[str, int]] | None) -> bool:
    """A task runs here when `local_tasks` names it, or (by default) when its host is this machine."""
    if local_tasks is not None:
        return plan.task in local_tasks
    return is_local_host(parse_address("task", plan.address)[0], local)


def wait_registered(registry: Registry, servers: list[Child], timeout: float, stop: StopTrap, chief: Child | None = None) -> str:
    """Wait until every ps and worker registered; returns an error message, or "" on success, on stop,
    or when `chief` (started early, waiting for them) exited: its own error says why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.requested:
        if not missing_servers(registry) or (chief is not None and chief.process.poll() is not None):
            return ""
        dead = next((c for c in servers if c.process.poll() is not None), None)
        if dead:
            return f"task not ready: {describe_not_ready(dead)}"
        time.sleep(0.2)
    if stop.requested:
        return ""
    local = {c.task: c for c in servers}
    missing = missing_servers(registry)
    details = ", ".join(describe_not_ready(local[t]) if t in local else f"{t} expected at {a}" for t, a in missing)
    return f"tasks not registered after {timeout:g}s: {details}"


def missing_servers(registry: Registry) -> list[tuple[TaskId, str]]:
    return [(task, address) for task, address in registry.missing() if not task.is_chief]


class Supervision:
    """Watch a running cluster: restart crashed tasks (bounded, with back-off), kill and restart a local
    task that hangs, restart the chief after a ps loss so it resumes from its checkpoint, and end the
    run when a task stays lost. What to do is decided by cluster/policy.py; this class only carries it out."""

    def __init__(
        self,
        supervisor: Supervisor,
        registry: Registry,
        cluster: ClusterConfig,
        startup_timeout: float,
        stop: StopTrap,
        run_dir: Path | None = None,
    ):
        self.supervisor, self.registry, self.cluster = supervisor, registry, cluster
        self.startup_timeout, self.stop = startup_timeout, stop
        self.run_dir = run_dir or supervisor.log_dir.parent
        self.failure = ""  # why the run must end (a task lost for good); the chief is asked to checkpoint
        self.disk_full = False  # the failure is a task log that could not be written (full disk, no permission)
        self.killed: set[TaskId] = set()  # hung local tasks killed, not yet restarted
        self.lost_ps: list[str] = []  # ps tasks restarted since the chief last started: why it exits 75
        self.chief_started_at = latest_checkpoint_step(self.run_dir)  # the checkpoint the chief resumes from

    def run(self, chief: Child) -> int:
        while True:
            code = self._watch(chief)
            if self.failure:
                if not self.disk_full:
                    say(self.failure + "; " + self._stop_outcome(chief.process.returncode), error=True)
                elif code != EXIT_FAILURE:  # else the chief, failing to write too, has said so itself
                    say(self.failure, error=True)
                return EXIT_FAILURE
            budget = self._budget(chief)
            stop_code = self.stop.exit_code if self.stop.requested else None
            decision = chief_decision(code, budget.used, self.cluster.max_restarts, stop_code)
            if isinstance(decision, Finish) and self.stop.requested and code != 0:
                return say_stopped(self.stop, latest_checkpoint_step(self.run_dir), self._how_stopped(chief.process.returncode))
            if isinstance(decision, Finish):
                if decision.exit_code == EXIT_RESTARTABLE:
                    say(f"{self._lost_names()} stayed unreachable; {self._resume_hint()}", error=True)
                if decision.exit_code and not self.stop.requested:  # the console shows only pstrain's lines
                    print(
                        f"pstrain: {chief.task.log_name} exited with code {code}; its log: {chief.log_path}",
                        file=sys.stderr,
                        flush=True,
                    )
                return decision.exit_code
            self._restart_dead_servers()
            failure = wait_registered(self.registry, self._servers(), self.startup_timeout, self.stop)
            if failure:
                say(failure, error=True)
                return EXIT_FAILURE
            count = f"{budget.used + 1} of {self.cluster.max_restarts}"
            say(f"lost {self._lost_names()}; restarting the chief to resume from {self._resume_point()} ({count})", warning=True)
            self.lost_ps = []
            self.registry.forget(chief.task)
            self.chief_started_at = latest_checkpoint_step(self.run_dir)
            chief = self._restarted(chief)

    def _lost_names(self) -> str:
        return ", ".join(dict.fromkeys(self.lost_ps)) or "a cluster task"

    def _resume_point(self) -> str:
        step = latest_checkpoint_step(self.run_dir)
        return f"checkpoint step {step}" if step is not None else "step 0 (no checkpoint yet)"

    def _resume_hint(self) -> str:
        return f"run the same command again to resume from {self._resume_point()}"

    def _stop_outcome(self, returncode: int) -> str:
        """What the chief did with the stop it was sent (Popen's `returncode`): its stop path exits with
        128+N after saving; killed by a signal (-N), it saved nothing."""
        if returncode == signal_exit_code(self.stop.signum or signal.SIGTERM):
            return f"stopped with a checkpoint; {self._resume_hint()}"
        killed = f"killed after {CHIEF_STOP_GRACE_S:g}s without checkpoint progress"
        how = killed if returncode == -signal.SIGKILL else f"exit {returncode_exit_code(returncode)}"
        return f"the chief could not checkpoint ({how}); {self._resume_hint()}"

    def _how_stopped(self, returncode: int) -> str:
        """How the chief ended after a stop (Popen's `returncode`), for `stop_outcome`: "saved" when its stop
        path wrote a newer checkpoint, "start-up" when it had trained nothing yet (no newer checkpoint, and
        it exited through its stop path or was ended by the signal itself), else what went wrong."""
        signum = self.stop.signum or signal.SIGTERM
        newer = latest_checkpoint_step(self.run_dir) != self.chief_started_at
        if returncode == signal_exit_code(signum):
            return "saved" if newer else "start-up"
        if returncode == -signum and not newer:
            return "start-up"
        if returncode == -signal.SIGKILL:
            return f"killed after {CHIEF_STOP_GRACE_S:g}s without checkpoint progress"
        return f"exit {returncode_exit_code(returncode)}"

    def _servers(self) -> list[Child]:
        return [c for c in self.supervisor.children if not c.task.is_chief]

    def _watch(self, chief: Child) -> int:
        forwarded, deadline, progress = False, 0.0, None
        while chief.process.poll() is None:
            if (self.stop.requested or self.failure) and not forwarded:
                chief.process.send_signal(self.stop.signum or signal.SIGTERM)
                forwarded = True
            if forwarded:  # the grace counts from the checkpoint write's last progress: a large model's takes longer
                if (seen := checkpoint_progress(self.run_dir)) != progress:
                    progress, deadline = seen, time.monotonic() + CHIEF_STOP_GRACE_S
                if time.monotonic() > deadline:
                    chief.process.kill()
                time.sleep(0.1)
            else:
                self._restart_dead_servers()
                self._check_silent()
                self._check_logs()
                self.stop.wait(0.1)  # a stop is forwarded as soon as it arrives
        self.supervisor.reap(chief)
        return returncode_exit_code(chief.process.returncode)

    def _restart_dead_servers(self) -> None:
        for child in self._servers():
            code = child.process.poll()
            if code is None:
                continue
            hung = child.task in self.killed
            self.killed.discard(child.task)
            what = (
                f"{child.task.log_name} sent no heartbeat for {self.cluster.heartbeat_timeout:g}s (hung?) and was killed"
                if hung
                else f"{child.task.log_name} exited ({returncode_exit_code(code)})"
            )
            budget = self._budget(child)
            decision = restart_decision(budget.used, self.cluster.max_restarts)
            if isinstance(decision, GiveUp):
                why = f"{decision.reason} ({budget_phrase(budget)})"
                self.failure = self.failure or f"{what} {why} (see {child.log_path})"
                continue
            if child.task.type == "ps":
                self.lost_ps.append(child.task.log_name)
            count = f"{budget.used + 1} of {self.cluster.max_restarts}"
            after = self._budget(child, restarting=True)
            say(
                f"{what}; restarting ({count}) in {decision.delay_s:g}s; its log: {child.log_path}; {budget_phrase(after)}",
                warning=True,
            )
            self.registry.forget(child.task)
            if self.stop.wait(decision.delay_s):  # a stop during the back-off: no restart, forward it at once
                return
            self._restarted(child)

    def _budget(self, child: Child, restarting: bool = False) -> RestartBudget:
        """`child`'s restarts that still count (with one now, when `restarting`)."""
        now = time.time()
        times = (*child.restart_times, now) if restarting else child.restart_times
        return restart_budget(times, now, self.cluster.max_restarts, self.cluster.restart_window)

    def _restarted(self, child: Child) -> Child:
        """Restart `child`; `pstrain status` shows its restart count and when it resets."""
        new = self.supervisor.restart(child)
        self.registry.note_restarts(new.task, new.restart_times)
        return new

    def _check_logs(self) -> None:
        """A task log that could not be written (no space, no permission) ends the run: the chief is asked
        to checkpoint and stop."""
        failed = next((c.log_error for c in self.supervisor.children if c.log_error), None)
        if failed is not None and not self.failure:
            self.failure, self.disk_full = str(failed), True

    def _check_silent(self) -> None:
        """A task silent past the heartbeat timeout: a hung local one is killed (then restarted like a dead
        one); one on another machine ends the run (after a checkpoint)."""
        here = {c.task: c for c in self._servers()}
        remote = []
        for task, record in self.registry.lost():
            if task.is_chief or task in self.killed:
                continue
            child = here.get(task)
            decision = silent_task_decision(child is not None, child is not None and child.process.poll() is None)
            if isinstance(decision, Kill) and child is not None:
                child.process.kill()  # SIGKILL by pid; the next look restarts it
                self.killed.add(task)
            elif isinstance(decision, EndRun):
                remote.append(f"{task} at {record.address}")
        if remote and not self.failure:
            self.failure = (
                f"lost {', '.join(remote)}: no heartbeat for {self.cluster.heartbeat_timeout:g}s (network cut or hung task?)"
            )


def linger_for_remote_nodes(registry: Registry, cluster: ClusterConfig, local: frozenset[str]) -> None:
    """Keep answering heartbeats briefly so tasks on other machines hear "stop" and exit."""
    hosts = [parse_address("task", record.address)[0] for record in registry.tasks.values()]
    if any(not is_local_host(host, local) for host in hosts):
        time.sleep(min(2 * cluster.heartbeat_interval + 0.5, 10.0))
