"""The watch over a running cluster (`ClusterWatch`) and the wait for its tasks to register.

Contract: `ClusterWatch.run(chief)` returns the run's exit code once the chief has ended for good. Until
then it restarts a ps or worker that exited (bounded by the restart budget, after its back-off; a stop cuts
the back-off short and nothing is restarted), kills a local task silent past the heartbeat timeout (then
restarts it like a dead one), restarts the chief after a ps loss so it resumes from its checkpoint (with
train.dense = "allreduce" every worker too, as for a lost worker: their collectives form again only among fresh
processes), and forwards a stop (or a task lost for good, or a task log that cannot be written) to the chief, which gets
CHIEF_STOP_GRACE_S without checkpoint progress before it is killed. What to do is decided by cluster/policy.py; this
module carries it out and says it on the console. It never starts a process itself: the `Supervisor`
(cluster/launch/supervisor.py) it is given starts, restarts and reaps them.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time

from cluster.config import ClusterConfig
from cluster.control.registry import Registry
from cluster.errors import EXIT_FAILURE, EXIT_RESTARTABLE, returncode_exit_code, signal_exit_code
from cluster.launch.console import say, say_stopped
from cluster.launch.supervisor import Child, Supervisor
from cluster.policy import (
    CannotReform,
    EndRun,
    Finish,
    GiveUp,
    Kill,
    ReformWorkers,
    RestartBudget,
    budget_phrase,
    chief_decision,
    collectives_decision,
    restart_budget,
    restart_decision,
    silent_task_decision,
)
from cluster.rundir import RunDir, checkpoint_progress, latest_checkpoint_step, write_stop_cause
from cluster.stop import StopTrap
from cluster.task import TaskId

CHIEF_STOP_GRACE_S = 8.0  # a stopped chief is killed after this long without progress in its checkpoint write


def describe_not_ready(child: Child) -> str:
    code = child.process.poll()
    state = "not registered" if code is None else f"exited with code {returncode_exit_code(code)}"
    return f"{child.task.log_name} at {child.setup.address} ({state}; see {child.log_path})"


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


class ClusterWatch:
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
        run_dir: RunDir,
        dense: str = "ps",
    ):
        self.supervisor, self.registry, self.cluster = supervisor, registry, cluster
        self.startup_timeout, self.stop = startup_timeout, stop
        self.run_dir = run_dir  # the run's layout: its checkpoints, its stop cause
        self.failure = ""  # why the run must end (a task lost for good); the chief is asked to checkpoint
        self.disk_full = False  # the failure is a task log that could not be written (full disk, no permission)
        self.killed: set[TaskId] = set()  # hung local tasks killed, not yet restarted
        self.lost_ps: list[str] = []  # ps tasks restarted since the chief last started: why it exits 75
        self.dense = dense  # train.dense: with "allreduce" a lost worker restarts every worker and the chief
        self.lost_workers: list[str] = []  # workers lost under "allreduce", not yet restarted: the chief is ended
        self.chief_started_at = latest_checkpoint_step(self.run_dir)  # the checkpoint the chief resumes from

    def run(self, chief: Child) -> int:
        while True:
            code = self._watch(chief)
            if self.lost_workers and not self.failure and not self.stop.requested:
                code = EXIT_RESTARTABLE  # ended here: it resumes from its checkpoint once every worker is fresh
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
            self._restart_dead_servers()  # also a task the chief found gone (exit 75) before this watch polled it
            if self.failure:  # a task past its restart budget
                say(self.failure + "; " + self._resume_hint(), error=True)
                return EXIT_FAILURE
            lost_workers = list(self.lost_workers)
            reformed = self._reform_workers()
            if isinstance(reformed, CannotReform):
                say(f"lost {self._lost_names(lost_workers)}: {reformed.reason} to resume from {self._resume_point()}", error=True)
                return EXIT_RESTARTABLE
            lost = self._lost_names(lost_workers, reformed=reformed is True)
            failure = wait_registered(self.registry, self._servers(), self.startup_timeout, self.stop)
            if failure:
                say(failure, error=True)
                return EXIT_FAILURE
            count = f"{budget.used + 1} of {self.cluster.max_restarts}"
            which = "every worker and the chief" if reformed else "the chief"
            say(f"lost {lost}; restarting {which} to resume from {self._resume_point()} ({count})", warning=True)
            self.lost_ps = []
            self.registry.forget(chief.task)
            self.chief_started_at = latest_checkpoint_step(self.run_dir)
            chief = self._restarted(chief)

    def _lost_names(self, workers: list[str] | None = None, reformed: bool = False) -> str:
        """The lost ps and `workers` (default: those not yet restarted) by name; where none was seen lost
        (the chief exited 75 first), "a worker" when the workers were re-formed, else "a cluster task"."""
        names = ", ".join(dict.fromkeys(self.lost_ps + (self.lost_workers if workers is None else workers)))
        if names:
            return names
        return "a worker (the chief saw the workers' collectives fail)" if reformed else "a cluster task"

    def _reform_workers(self) -> bool | CannotReform:
        """Before the chief restarts: every worker restarted (killed by pid first where running) when
        `collectives_decision` asks it; True then. Only the lost workers' restarts count against their budgets."""
        here = [c for c in self._servers() if c.task.type == "worker"]
        decision = collectives_decision(self.dense, len(self.cluster.workers), len(here))
        if decision is None:
            return False
        if isinstance(decision, CannotReform):
            return decision
        for child in here:
            if child.process.poll() is None:
                child.process.kill()
        for child in here:
            self.registry.forget(child.task)
            self.killed.discard(child.task)
            self._restarted(child, counted=child.task.log_name in self.lost_workers)
        self.lost_workers = []
        return True

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
        how = (
            f"killed after {CHIEF_STOP_GRACE_S:g}s without checkpoint progress"
            if returncode == -signal.SIGKILL
            else f"exit {returncode_exit_code(returncode)}"
        )
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
                if self.stop.commanded and not self.failure:  # the chief's stop line names the command, not the signal
                    with contextlib.suppress(OSError):
                        write_stop_cause(self.run_dir, self.stop.cause)
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
                if self.lost_workers and chief.process.poll() is None:
                    chief.process.kill()  # its collectives are gone: it resumes from its checkpoint (run)
                self._check_silent()
                self._check_logs()
                self.stop.wait(0.1)  # a stop is forwarded as soon as it arrives
        self.supervisor.reap(chief)
        return returncode_exit_code(chief.process.returncode)

    def _restart_dead_servers(self) -> None:
        for child in self._servers():
            code = child.process.poll()
            if code is None or child.task.log_name in self.lost_workers:
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
            workers_here = sum(c.task.type == "worker" for c in self._servers())
            reform = collectives_decision(self.dense, len(self.cluster.workers), workers_here)
            if child.task.type == "worker" and isinstance(reform, ReformWorkers):
                self.lost_workers.append(child.task.log_name)
                say(
                    f'{what}; train.dense = "allreduce": the other workers\' collectives ended with it; '
                    f"its log: {child.log_path}",
                    warning=True,
                )
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

    def _restarted(self, child: Child, counted: bool = True) -> Child:
        """Restart `child`; `pstrain status` shows its restart count and when it resets. One not `counted`
        keeps its restart budget (restarted for another task's loss)."""
        new = self.supervisor.restart(child)
        if not counted:
            new.restart_times = child.restart_times
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
