"""The control plane's gRPC server (in the chief's launcher) and the calls clients make."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent import futures

import grpc

from cluster.control.proto import control_pb2 as pb
from cluster.control.proto import control_pb2_grpc as pb_grpc
from cluster.control.registry import Registry
from cluster.control.security import Credentials, TokenInterceptor, channel, server_credentials
from cluster.control.status_row import TaskRow
from cluster.doors import is_unix_target
from cluster.task import TaskId

RPC_TIMEOUT_S = 5.0


def _resources(r: pb.Resources) -> dict[str, float]:
    return {"cpu_percent": r.cpu_percent, "rss_bytes": r.rss_bytes, "gpu_memory_bytes": r.gpu_memory_bytes}


class ControlService(pb_grpc.ControlPlaneServicer):
    """The launcher's side of the ControlPlane gRPC service (control.proto): registration, heartbeats,
    status, stop and assignment, decided by the Registry. Named apart from the generated `ControlPlane`
    class (control_pb2_grpc), the client-side helper this is not."""

    def __init__(
        self,
        registry: Registry,
        heartbeat_interval: float,
        on_stop: Callable[[str], None],
        assignment: Callable[[list[str]], tuple[dict, list[tuple[str, int, int]]]],
    ):
        self.registry = registry
        self.heartbeat_interval = heartbeat_interval
        self.on_stop = on_stop
        self.assignment = assignment

    def Register(self, request, context):
        versions = {
            "pstrain": request.versions.pstrain,
            "tensorflow": request.versions.tensorflow,
            "python": request.versions.python,
        }
        accepted, reason = self.registry.register(
            TaskId(request.task.type, request.task.index),
            request.host,
            request.address,
            request.pid,
            versions,
            list(request.devices),
        )
        return pb.RegisterReply(
            accepted=accepted,
            reason=reason,
            heartbeat_interval_s=self.heartbeat_interval,
            heartbeat_timeout_s=self.registry.heartbeat_timeout,
        )

    def Heartbeat(self, request, context):
        key = TaskId(request.task.type, request.task.index)
        stop = self.registry.heartbeat(
            key,
            request.state,
            _resources(request.resources),
            request.step,
            dict(request.gradients_by_worker),
        )
        reason = self.registry.stop_reason if stop and key.is_chief else ""
        return pb.HeartbeatReply(stop=stop, unknown=not stop and not self.registry.knows(key), stop_reason=reason)

    def Status(self, request, context):
        reply = status_message(self.registry.status())
        reply.time = time.time()
        return reply

    def Stop(self, request, context):
        reason = request.reason or "pstrain stop"
        if " from " not in reason:  # an older client: name where the call came from
            reason += f" from {peer_host(context.peer())}"
        self.on_stop(reason)
        return pb.StopReply(accepted=True)

    def Assignment(self, request, context):
        spec, tasks = self.assignment(list(request.host_addresses))
        return pb.AssignmentReply(
            cluster_json=json.dumps(spec),
            tasks=[pb.TaskId(type=t, index=i) for t, i, _ in tasks],
            worker_gpus=[gpu for _, _, gpu in tasks],
        )


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:127.0.0.1:5432", "ipv6:[::1]:5432"). Pure."""
    address = peer.partition(":")[2] or peer
    return address.rpartition(":")[0].strip("[]") or address


def status_message(status: dict) -> pb.StatusReply:
    reply = pb.StatusReply(
        state=status["state"],
        step=status["step"],
        total_steps=status["total_steps"],
        max_restarts=status.get("max_restarts", 0),
        restart_window_s=status.get("restart_window_s", 0.0),
        step_age_s=status.get("step_age_s", -1.0),
    )
    reply.tasks.extend(TaskRow.from_dict(row).message() for row in status["tasks"])
    return reply


def status_dict(reply: pb.StatusReply) -> dict:
    """The inverse of status_message, for `pstrain status --json`."""
    tasks = [TaskRow.from_message(t).as_dict() for t in reply.tasks]
    return {
        "state": reply.state,
        "step": reply.step,
        "total_steps": reply.total_steps,
        "max_restarts": reply.max_restarts,
        "restart_window_s": reply.restart_window_s,
        "step_age_s": reply.step_age_s,
        "tasks": tasks,
    }


def serve(servicer: ControlService, bind: str, creds: Credentials) -> tuple[grpc.Server, int]:
    """Start the server on `bind` (host:port, port 0 = free; or a closed local cluster's `unix:PATH`,
    which the socket file's permissions and the token guard, without TLS); returns it and the bound port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[TokenInterceptor(creds.token)])
    pb_grpc.add_ControlPlaneServicer_to_server(servicer, server)
    tls = None if is_unix_target(bind) else server_credentials(creds)
    port = server.add_secure_port(bind, tls) if tls else server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"cannot listen on {bind}")
    server.start()
    return server, port


def stub(address: str, creds: Credentials) -> pb_grpc.ControlPlaneStub:
    return pb_grpc.ControlPlaneStub(channel(address, creds))
