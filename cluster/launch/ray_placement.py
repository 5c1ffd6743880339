"""Pure planning for `pstrain launch --engine ray`: the placement group that reserves the whole cluster,
and the cluster config built from where Ray placed each task. No Ray import, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cluster.config import ClusterConfig, ConfigError, format_address, is_loopback, parse_address
from cluster.task import TaskId

CPUS_PER_TASK = 1  # what each task's bundle asks of Ray (its logical CPU: one process)


@dataclass(frozen=True)
class Reservation:
    """One placement group: its bundles, Ray's strategy, and each task's bundle index."""

    bundles: list[dict[str, float]]
    strategy: str
    bundle_of: dict[TaskId, int]


@dataclass(frozen=True)
class Placed:
    """Where Ray placed one task: its node's address, a free port there, the GPUs Ray gave it."""

    host: str
    port: int
    gpus: tuple[int, ...] = ()


def tasks_of(cluster: ClusterConfig) -> list[TaskId]:
    """Every task, in start order: ps, workers, then the chief."""
    ps = [TaskId("ps", i) for i in range(len(cluster.ps))]
    return ps + [TaskId("worker", i) for i in range(len(cluster.workers))] + [TaskId("chief", 0)]


def reservation(cluster: ClusterConfig, worker_gpus: bool) -> Reservation:
    """One bundle per ps, worker and the chief (PACK: Ray puts them where they fit, all at once); a
    worker's bundle asks one GPU when `worker_gpus`. With `cluster.spread_workers` the group is
    STRICT_SPREAD over one bundle per worker, every worker on a node of its own, and ps k and the
    chief ride in worker bundles (k mod N and 0): Ray spreads every bundle of a group, so a bundle
    of their own would take a node each."""
    tasks = tasks_of(cluster)
    workers = len(cluster.workers)

    def own(task: TaskId) -> dict[str, float]:
        gpu = {"GPU": 1.0} if worker_gpus and task.type == "worker" else {}
        return {"CPU": float(CPUS_PER_TASK), **gpu}

    if not cluster.spread_workers:
        return Reservation([own(t) for t in tasks], "PACK", {t: i for i, t in enumerate(tasks)})
    bundle_of = {t: (t.index if t.type == "worker" else t.index % workers if t.type == "ps" else 0) for t in tasks}
    bundles = [own(TaskId("worker", i)) for i in range(workers)]
    for task, index in bundle_of.items():
        if task.type != "worker":
            bundles[index]["CPU"] += CPUS_PER_TASK
    return Reservation(bundles, "STRICT_SPREAD", bundle_of)


def task_resources(task: TaskId, worker_gpus: bool) -> dict[str, float]:
    """What one task's actor asks of its bundle."""
    return {"num_cpus": float(CPUS_PER_TASK), "num_gpus": 1.0 if worker_gpus and task.type == "worker" else 0.0}


def check_counts_only(cluster: ClusterConfig) -> None:
    """Ray places the tasks: a fixed host:port for one of them cannot be honoured, so it is refused."""
    named = [("cluster.chief", cluster.chief)] + [(f"cluster.ps[{i}]", a) for i, a in enumerate(cluster.ps)]
    named += [(f"cluster.workers[{i}]", a) for i, a in enumerate(cluster.workers)]
    for name, address in named:
        if parse_address(name, address)[1] != 0:
            raise ConfigError(f'{name}: engine = "ray" places every task itself; give counts (ps = 2), not addresses')


def placed_cluster(cluster: ClusterConfig, placed: dict[TaskId, Placed], control: str) -> ClusterConfig:
    """The cluster config of one placement: each task at its node's address and port, each worker
    pinned to the GPU Ray gave it (none: a CPU worker), the control plane at `control`."""

    def at(task: TaskId) -> str:
        return format_address(placed[task].host, placed[task].port)

    workers = range(len(cluster.workers))
    return replace(
        cluster,
        chief=at(TaskId("chief", 0)),
        ps=tuple(at(TaskId("ps", i)) for i in range(len(cluster.ps))),
        workers=tuple(at(TaskId("worker", i)) for i in workers),
        worker_gpus=tuple(placed[TaskId("worker", i)].gpus[0] if placed[TaskId("worker", i)].gpus else None for i in workers),
        control=control,
    )


def unshared_nodes(seen_by: dict[str, bool]) -> list[str]:
    """The nodes (by address) that could not read the probe file written to the run dir."""
    return sorted(host for host, seen in seen_by.items() if not seen)


def loopback_address(address: str) -> bool:
    """Whether a Ray address names this machine's loopback: Ray must then keep to 127.0.0.1 itself."""
    return address not in ("", "auto") and is_loopback(parse_address("--address", address)[0])
