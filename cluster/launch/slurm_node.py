"""`pstrain node --slurm`: this node's share of a Slurm job, from the step's SLURM_* variables.

The first node runs the launcher (control plane, chief, its own ps/workers); every other node runs
its ps/workers as `pstrain node` does, and they register with the first node's control plane.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from cluster.config import Config, ConfigError, parse_address, resolve
from cluster.launch.launcher import launch, shared_control_env
from cluster.rundir import RunDir
from cluster.slurm import PORT_BASE, slurm_node


def slurm_config(raw: dict, env: Mapping[str, str], port_base: int = PORT_BASE) -> tuple[Config, frozenset, bool]:
    """(config with every address and this node's GPUs, this node's ps/workers, whether it runs the chief)."""
    cluster_raw = {k: v for k, v in dict(raw.get("cluster", {})).items() if k not in ("host", "chief", "control", "worker_gpus")}
    config = resolve({**raw, "cluster": cluster_raw})
    if not config.train.run_dir:
        raise ConfigError("train.run_dir: not set; every node of a Slurm job must name the same run dir (a shared file system)")
    node = slurm_node(env, config.cluster, port_base)
    return replace(config, cluster=node.cluster), node.local_tasks, node.runs_chief


def run_slurm_node(config: Config, layout: RunDir, local_tasks: frozenset, runs_chief: bool) -> int:
    """Run this node's share (`slurm_config`'s answer) in `layout`, the job's shared run dir."""
    env = shared_control_env(config)  # every node needs the job's token (none is generated) and TLS CA
    if runs_chief:
        port = parse_address("cluster.control", config.cluster.control)[1]
        return launch(config, layout, local_tasks=set(local_tasks), control_bind=f"0.0.0.0:{port}", where="slurm")
    from cluster.launch.node import run_node

    tasks = sorted(local_tasks, key=lambda t: (t[0] != "ps", t[1]))
    return run_node(config.cluster, tasks, env, layout.logs, where="slurm")
