"""Pure planning: a resolved cluster config -> each task's TF_CONFIG and environment."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import ClusterConfig
from cluster.task import TaskId
from cluster.tfconfig import TF_CONFIG_ENV, task_tf_config

# Every task: fail fast on unreachable peers so ClusterCoordinator can retry (TF's PS tutorial),
# legacy Keras (Keras 3 has no ParameterServerStrategy), unbuffered logs.
COMMON_ENV = {
    "GRPC_FAIL_FAST": "use_caller",
    "TF_USE_LEGACY_KERAS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "1",
    "PYTHONUNBUFFERED": "1",
}


@dataclass(frozen=True)
class TaskPlan:
    """One process of the cluster: its role, its address and the environment it starts with."""

    task: TaskId
    address: str
    env: dict[str, str]


def cluster_spec(cluster: ClusterConfig) -> dict[str, list[str]]:
    """The ``cluster`` part of TF_CONFIG."""
    return {"chief": [cluster.chief], "ps": list(cluster.ps), "worker": list(cluster.workers)}


def visible_devices(cluster: ClusterConfig, task_type: str, index: int) -> str:
    """CUDA_VISIBLE_DEVICES: a worker sees its own GPU; ps and chief see none unless configured."""
    if task_type == "worker":
        gpu = cluster.worker_gpus[index]
        return "" if gpu is None else str(gpu)
    return cluster.ps_gpus if task_type == "ps" else cluster.chief_gpus


def plan_task(cluster: ClusterConfig, task_type: str, index: int) -> TaskPlan:
    address = cluster_spec(cluster)[task_type][index]
    env = dict(COMMON_ENV)
    env[TF_CONFIG_ENV] = task_tf_config(cluster_spec(cluster), task_type, index)
    env["CUDA_VISIBLE_DEVICES"] = visible_devices(cluster, task_type, index)
    return TaskPlan(task=TaskId(task_type, index), address=address, env=env)


def plan_servers(cluster: ClusterConfig) -> list[TaskPlan]:
    """The passive TF servers, ps first (workers' closures read variables from them)."""
    return [plan_task(cluster, "ps", i) for i in range(len(cluster.ps))] + [
        plan_task(cluster, "worker", i) for i in range(len(cluster.workers))
    ]
