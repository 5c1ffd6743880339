"""The thin agent inside every task: register with the chief's control plane, then heartbeat.

It stops its task when the control plane says so, or when the control plane has been unreachable
for longer than the heartbeat timeout (a node whose chief disappeared does not linger).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import psutil

from cluster.control.proto import control_pb2 as pb
from cluster.control.security import Credentials
from cluster.control.service import RPC_TIMEOUT_S, stub
from cluster.task import TaskId
from cluster.taskenv import TaskEnv
from cluster.versions import local_versions

log = logging.getLogger("pstrain.agent")


class Refused(RuntimeError):
    """The chief refused this task; the message says why."""


@dataclass
class Report:
    """What a heartbeat carries beyond resources (the chief fills step and gradients)."""

    state: str = "serving"
    step: int = 0
    gradients_by_worker: dict[int, int] | None = None


class Agent:
    def __init__(
        self,
        control: str,
        creds: Credentials,
        task_type: str,
        index: int,
        address: str,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        gpu_memory: Callable[[], int] = lambda: 0,
    ):
        self.control, self.task = control, pb.TaskId(type=task_type, index=index)
        self.address = address
        self.interval, self.timeout = heartbeat_interval, heartbeat_timeout
        self.gpu_memory = gpu_memory
        self.report = Report()
        self._stub = stub(control, creds)
        self._process = psutil.Process()
        self._process.cpu_percent()  # prime: the first call always returns 0
        self._done = threading.Event()
        self._wake = threading.Event()  # set by `update` and `close`: heartbeat now
        self.name = TaskId(task_type, index).name
        self._devices: list[str] = []

    def register(self, devices: list[str], deadline_s: float) -> None:
        """Register, retrying while the control plane is not up yet; raises Refused or TimeoutError."""
        self._devices = list(devices)
        versions = local_versions()
        request = pb.RegisterRequest(
            task=self.task,
            host=socket.gethostname(),
            address=self.address,
            pid=os.getpid(),
            versions=pb.Versions(**versions),
            devices=devices,
        )
        end = time.monotonic() + deadline_s
        while True:
            try:
                reply = self._stub.Register(request, timeout=RPC_TIMEOUT_S)
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise Refused(f"the control plane at {self.control} refused our token; use the cluster's token") from None
                if time.monotonic() > end:
                    raise TimeoutError(f"no control plane at {self.control} after {deadline_s:g}s ({e.code().name})") from None
                time.sleep(0.5)
        if not reply.accepted:
            raise Refused(reply.reason)
        # The chief's settings win: a node that only knows the chief's address learns them here.
        self.interval = reply.heartbeat_interval_s or self.interval
        self.timeout = reply.heartbeat_timeout_s or self.timeout
        log.info("%s registered with the control plane at %s", self.name, self.control)

    def start(self, on_stop: Callable[[str, bool], None]) -> threading.Thread:
        """Heartbeat in the background; `on_stop(reason, lost)` when told to stop (lost=False) or
        when the control plane stayed unreachable past the timeout (lost=True)."""
        thread = threading.Thread(target=self._loop, args=(on_stop,), name="pstrain-heartbeat", daemon=True)
        thread.start()
        return thread

    def update(self, report: Report) -> None:
        """Report `report` from now on, and send it at once (a new step is seen by `pstrain status` now,
        not a heartbeat interval later)."""
        self.report = report
        self._wake.set()

    def close(self) -> None:
        self._done.set()
        self._wake.set()

    def _loop(self, on_stop: Callable[[str, bool], None]) -> None:
        last_ok = time.monotonic()
        wait = 0.0  # the first heartbeat goes out at once
        while not self._done.is_set():
            self._wake.wait(wait)
            self._wake.clear()
            if self._done.is_set():
                return
            wait = self.interval
            try:
                # A deadline well inside the timeout, so a silent network is noticed in time.
                reply = self._stub.Heartbeat(self._heartbeat(), timeout=min(RPC_TIMEOUT_S, self.timeout / 2))
                last_ok = time.monotonic()
                if reply.stop:
                    on_stop(reply.stop_reason or "the control plane asked this task to stop", False)
                    return
                if reply.unknown:  # a restarted chief (a new control plane): join it
                    log.info("%s: the control plane at %s does not know this task; registering again", self.name, self.control)
                    self.register(self._devices, deadline_s=self.timeout)
            except Refused as e:
                on_stop(f"the control plane at {self.control} refused this task: {e}", True)
                return
            except TimeoutError:
                pass  # not registered again yet: the next heartbeat asks once more
            except grpc.RpcError as e:
                if time.monotonic() - last_ok > self.timeout:
                    reason = f"the control plane at {self.control} has been unreachable for {self.timeout:g}s ({e.code().name})"
                    on_stop(reason, True)
                    return

    def _heartbeat(self) -> pb.HeartbeatRequest:
        memory = self._process.memory_info().rss
        for child in self._process.children(recursive=True):
            try:
                memory += child.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        report = self.report
        return pb.HeartbeatRequest(
            task=self.task,
            state=report.state,
            resources=pb.Resources(cpu_percent=self._process.cpu_percent(), rss_bytes=memory, gpu_memory_bytes=self.gpu_memory()),
            step=report.step,
            gradients_by_worker=report.gradients_by_worker or {},
        )


def agent_from_env(task_type: str, index: int, address: str, gpu_memory: Callable[[], int] = lambda: 0) -> Agent | None:
    """The agent the launcher or node asked for through the environment; None without a control plane."""
    env = TaskEnv.from_env()
    if not env.control:
        return None
    return Agent(
        env.control,
        Credentials(token=env.token, tls_ca=env.tls_ca),
        task_type,
        index,
        address,
        heartbeat_interval=env.heartbeat_interval,
        heartbeat_timeout=env.heartbeat_timeout,
        gpu_memory=gpu_memory,
    )
