"""Pure planning: a resolved cluster config -> each task's TF_CONFIG and environment."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import ClusterConfig
from cluster.task import TaskId
from cluster.taskenv import TaskEnv
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
class TaskSetup:
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


def gpu_sharers(cluster: ClusterConfig) -> dict[tuple[str, int], list[int]]:
    """(worker host, GPU index) -> the workers placed there, in order."""
    out: dict[tuple[str, int], list[int]] = {}
    for i, gpu in enumerate(cluster.worker_gpus):
        if gpu is not None:
            out.setdefault((cluster.workers[i].rsplit(":", 1)[0], gpu), []).append(i)
    return out


def gpu_env(cluster: ClusterConfig, index: int) -> dict[str, str]:
    """A worker's GPU memory settings: PSTRAIN_GPU_MEMORY_MB (its server's limit) where the config sets
    one, else memory growth where it shares its GPU, so the first worker does not take it all."""
    gpu = cluster.worker_gpus[index]
    if gpu is None:
        return {}
    if cluster.worker_gpu_memory_mb:
        return TaskEnv(gpu_memory_mb=str(cluster.worker_gpu_memory_mb)).to_env()
    shared = len(gpu_sharers(cluster)[(cluster.workers[index].rsplit(":", 1)[0], gpu)]) > 1
    return {"TF_FORCE_GPU_ALLOW_GROWTH": "true"} if shared else {}


def gpu_line(cluster: ClusterConfig) -> str:
    """One line for the launch: where each worker computes, and how workers that share a GPU share it."""
    sharers = gpu_sharers(cluster)
    if not sharers:
        return f"workers on the CPU ({len(cluster.workers)})"
    placed = ", ".join(f"worker {i} {'CPU' if gpu is None else f'GPU {gpu}'}" for i, gpu in enumerate(cluster.worker_gpus))
    shared = [f"GPU {gpu} by workers {', '.join(map(str, ws))}" for (_, gpu), ws in sharers.items() if len(ws) > 1]
    memory = f"each worker limited to {cluster.worker_gpu_memory_mb} MiB" if cluster.worker_gpu_memory_mb else "memory growth on"
    return placed + (f"; shared: {'; '.join(shared)} ({memory})" if shared else "")


def task_setup(cluster: ClusterConfig, task_type: str, index: int) -> TaskSetup:
    address = cluster_spec(cluster)[task_type][index]
    env = dict(COMMON_ENV)
    env[TF_CONFIG_ENV] = task_tf_config(cluster_spec(cluster), task_type, index)
    env["CUDA_VISIBLE_DEVICES"] = visible_devices(cluster, task_type, index)
    if task_type == "worker":
        env.update(gpu_env(cluster, index))
    return TaskSetup(task=TaskId(task_type, index), address=address, env=env)


def server_setups(cluster: ClusterConfig) -> list[TaskSetup]:
    """The passive TF servers, ps first (workers' closures read variables from them)."""
    return [task_setup(cluster, "ps", i) for i in range(len(cluster.ps))] + [
        task_setup(cluster, "worker", i) for i in range(len(cluster.workers))
    ]
