"""This node's share of a cluster, from the variables Slurm sets for a job step. Pure.

One `pstrain node --slurm` runs per node (`srun --ntasks-per-node=1`). Nodes keep Slurm's order
(`node[9-10]` is node9, then node10; nothing is sorted as text). The chief and the control plane
run on the first node; ps task k on node k mod K; workers fill the nodes in order, as many per
node as there are workers per GPU set; a worker's GPU is taken from what Slurm assigned to this
node (CUDA_VISIBLE_DEVICES, else SLURM_STEP_GPUS, else SLURM_JOB_GPUS), never a raw index.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from cluster.config import ClusterConfig, ConfigError, format_address

PORT_BASE = 2222  # chief; control +1; ps k +2+k; worker j +2+M+j (distinct on every node)
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _split_top(text: str, variable: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"{variable}: nested '[' in {text!r}; expected e.g. node[1-4],gpu[01-03,07]")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"{variable}: ']' without '[' in {text!r}; expected e.g. node[1-4]")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"{variable}: unclosed '[' in {text!r}; expected e.g. node[1-4]")
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str, variable: str, text: str) -> list[str]:
    values = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item.strip())
        if not match:
            raise ConfigError(f"{variable}: {item!r} in {text!r} is not a number or range; expected e.g. [01-03,07]")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ConfigError(f"{variable}: range {item!r} in {text!r} runs backwards; write low-high")
        width = len(first) if first.startswith("0") else 0
        values += [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    return values


def expand_hostlist(text: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's compressed host list -> host names, in Slurm's order: node[9-10],gpu[01-02]x ->
    node9, node10, gpu01x, gpu02x. Several bracket groups in one name multiply out."""
    if not text or not text.strip():
        raise ConfigError(f"{variable}: empty; run under Slurm (sbatch/srun) or set it, e.g. node[1-2]")
    hosts: list[str] = []
    for part in _split_top(text.strip(), variable):
        if not part or "[]" in part:
            raise ConfigError(f"{variable}: empty host name or range in {text!r}; expected e.g. node[1-4],login1")
        names = [""]
        for literal, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            if not literal and not body:
                continue
            choices = _expand_ranges(body, variable, text) if body else [""]
            names = [n + literal + c for n in names for c in choices]
        hosts += names
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"{variable}: {text!r} names a host twice; each node once")
    return hosts


def expand_tasks_per_node(text: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """'2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in (text or "").split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ConfigError(f"{variable}: {item!r} in {text!r} is not N or N(xM); expected e.g. 2(x3),1")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def assigned_gpus(env: Mapping[str, str]) -> tuple[str, list[int]]:
    """(the variable they came from, the GPUs this node's step may use, as this process must name them)."""
    for variable in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = env.get(variable, "").strip()
        if value and value not in ("NoDevFiles", "void"):
            gpus = []
            for item in value.split(","):
                if not item.strip().isdigit():
                    raise ConfigError(f"{variable}: {item!r} in {value!r} is not a GPU index; pstrain expects e.g. 0,1")
                gpus.append(int(item))
            return variable, gpus
    return "", []


def check_port_base(port_base: int, ps: int, workers: int) -> None:
    last = port_base + 2 + ps + workers - 1
    if port_base < 1024 or last > 65535:
        highest = 65535 - ps - workers - 1
        raise ConfigError(f"--port-base: {port_base} puts the ports at {port_base}-{last}; give a base from 1024 to {highest}")


@dataclass(frozen=True)
class SlurmNode:
    nodes: tuple[str, ...]  # in Slurm's order
    node_index: int  # this node's place in `nodes` (SLURM_NODEID)
    cluster: ClusterConfig  # every address; this node's workers carry their GPUs
    local_tasks: frozenset[tuple[str, int]]  # the ps/workers this node runs

    @property
    def runs_chief(self) -> bool:
        return self.node_index == 0


def _int_var(env: Mapping[str, str], variable: str) -> int:
    value = env.get(variable, "")
    if not value.strip().isdigit():
        raise ConfigError(f"{variable}: expected a number, got {value!r}; run pstrain node --slurm inside srun")
    return int(value)


def worker_nodes(workers: int, nodes: int) -> list[int]:
    """Node of each worker: filled in order, ceil(workers / nodes) per node."""
    per_node = math.ceil(workers / nodes)
    return [j // per_node for j in range(workers)]


def slurm_node(env: Mapping[str, str], cluster: ClusterConfig, port_base: int = PORT_BASE) -> SlurmNode:
    """This node's tasks and the whole cluster's addresses, from a job step's SLURM_* variables."""
    nodelist_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    if not env.get(nodelist_var):
        nodelist_var = "SLURM_NODELIST"
    nodes = expand_hostlist(env.get(nodelist_var, ""), nodelist_var)
    count_var = "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES") else "SLURM_JOB_NUM_NODES"
    if env.get(count_var) and _int_var(env, count_var) != len(nodes):
        raise ConfigError(f"{count_var}: {env[count_var]} but {nodelist_var} names {len(nodes)} nodes; they must agree")
    tasks_var = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    if env.get(tasks_var):
        tasks = expand_tasks_per_node(env[tasks_var], tasks_var)
        if len(tasks) != len(nodes) or any(t != 1 for t in tasks):
            raise ConfigError(
                f"{tasks_var}: {env[tasks_var]!r}; run one pstrain node per node (srun --ntasks-per-node=1) on {len(nodes)} nodes"
            )
    node_index = _int_var(env, "SLURM_NODEID")
    if node_index >= len(nodes):
        raise ConfigError(f"SLURM_NODEID: {node_index} but {nodelist_var} names {len(nodes)} nodes")
    ps_count, worker_count = len(cluster.ps), len(cluster.workers)
    check_port_base(port_base, ps_count, worker_count)
    if worker_count < len(nodes):
        raise ConfigError(
            f"cluster.workers: {worker_count} workers on {len(nodes)} nodes leave a node idle; use at most {worker_count} nodes"
        )
    placement = worker_nodes(worker_count, len(nodes))
    mine = [j for j, n in enumerate(placement) if n == node_index]
    source, gpus = assigned_gpus(env)
    if gpus and len(gpus) < len(mine):
        raise ConfigError(f"{source}: this node has {len(gpus)} GPUs for {len(mine)} workers; use --gpus-per-node={len(mine)}")
    worker_gpus = [None] * worker_count
    for slot, j in enumerate(mine):
        worker_gpus[j] = gpus[slot] if gpus else None
    chief_host = nodes[0]
    resolved = replace(
        cluster,
        chief=format_address(chief_host, port_base),
        control=format_address(chief_host, port_base + 1),
        ps=tuple(format_address(nodes[k % len(nodes)], port_base + 2 + k) for k in range(ps_count)),
        workers=tuple(format_address(nodes[n], port_base + 2 + ps_count + j) for j, n in enumerate(placement)),
        worker_gpus=tuple(worker_gpus),
    )
    local = {("ps", k) for k in range(ps_count) if k % len(nodes) == node_index} | {("worker", j) for j in mine}
    return SlurmNode(tuple(nodes), node_index, resolved, frozenset(local))
