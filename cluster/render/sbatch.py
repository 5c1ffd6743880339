"""`pstrain render slurm`: an sbatch script for the config's cluster. Pure.

One `pstrain node --slurm` per node (srun, one task per node, the whole step ends if one fails);
the chief on the first node; GPUs as Slurm assigns them. Slurm signals the batch shell 120 s
before the time limit, and the shell asks the chief to checkpoint and stop the cluster
(`pstrain stop`); submitting the same script again resumes from that checkpoint.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass

from cluster.config import Config, ConfigError
from cluster.slurm import PORT_BASE, check_port_base

SRUN = "srun --ntasks-per-node=1 --kill-on-bad-exit=1"
TIME = re.compile(r"(\d+-)?\d+(:\d\d){0,2}")


@dataclass(frozen=True)
class SlurmOptions:
    config_path: str  # as every node sees it (a shared file system)
    nodes: int = 0  # 0: ceil(workers / gpus_per_node)
    gpus_per_node: int = 1
    time: str = "01:00:00"
    partition: str = ""
    job_name: str = "pstrain"
    port_base: int = PORT_BASE
    stop_before_s: int = 120  # SIGTERM this long before the time limit


def node_count(config: Config, options: SlurmOptions) -> int:
    workers = len(config.cluster.workers)
    nodes = options.nodes or math.ceil(workers / max(options.gpus_per_node, 1))
    if not 1 <= nodes <= workers:
        raise ConfigError(f"--nodes: {nodes} for {workers} workers; give 1 to {workers} (each node runs at least one worker)")
    if options.gpus_per_node and math.ceil(workers / nodes) > options.gpus_per_node:
        raise ConfigError(
            f"--gpus-per-node: {options.gpus_per_node} is fewer than the {math.ceil(workers / nodes)} workers per node; "
            "ask for more GPUs or nodes"
        )
    return nodes


def render_sbatch(config: Config, options: SlurmOptions) -> str:
    if not config.train.run_dir:
        raise ConfigError("train.run_dir: not set; the nodes of a Slurm job share one run dir: name one on a shared file system")
    if not TIME.fullmatch(options.time):
        raise ConfigError(f"--time: {options.time!r} is not a Slurm time; use e.g. 01:00:00 or 1-12:00:00")
    if options.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node: {options.gpus_per_node}; give 0 (CPU) or more")
    nodes = node_count(config, options)
    check_port_base(options.port_base, len(config.cluster.ps), len(config.cluster.workers))
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name={options.job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={options.time}",
        f"#SBATCH --signal=B:TERM@{options.stop_before_s}",
        f"#SBATCH --output={options.job_name}-%j.out",
    ]
    if options.gpus_per_node:
        header.append(f"#SBATCH --gpus-per-node={options.gpus_per_node}")
    if options.partition:
        header.append(f"#SBATCH --partition={options.partition}")
    config_arg = shlex.quote(options.config_path)
    body = f"""
# Rendered by `pstrain render slurm`: {len(config.cluster.ps)} ps, {len(config.cluster.workers)} workers on {nodes} node(s).
set -euo pipefail
# One token for the job's control plane; srun passes the environment to every node.
export PSTRAIN_TOKEN="${{PSTRAIN_TOKEN:-$(od -An -tx1 -N16 /dev/urandom | tr -d ' \\n')}}"
first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# Slurm signals this shell before the time limit: the chief checkpoints and stops every node. The job
# then exits 143 (SIGTERM's 128+N), not 0: it stopped at the time limit, it did not finish.
trap 'stopped=143; pstrain stop --chief "$first_node:{options.port_base + 1}" || true' TERM
{SRUN} pstrain node --slurm --config {config_arg} --port-base {options.port_base} &
step=$!
wait "$step" || true  # returns early when the trap ran
wait "$step"
exit "${{stopped:-0}}"
"""
    return "\n".join(header) + "\n" + body
