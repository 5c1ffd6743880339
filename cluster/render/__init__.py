"""Deployments for existing cluster engines (Kubernetes TFJob, Slurm), rendered from one config."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cluster.config import Config


def pod_config_toml(config: Config, run_dir: str) -> str:
    """The config a pod or node reads: counts, heartbeats and every training setting, no addresses
    (TF_CONFIG, or the scheduler's node list, gives them) and no secrets (the token comes from the
    environment)."""
    c, t = config.cluster, config.train
    cluster = {
        "ps": len(c.ps),
        "workers": len(c.workers),
        "heartbeat_interval": c.heartbeat_interval,
        "heartbeat_timeout": c.heartbeat_timeout,
        "max_restarts": c.max_restarts,
        "restart_window": c.restart_window,
    }
    train = {
        "job": t.job,
        "steps": t.steps,
        "global_batch_size": t.global_batch_size,
        "replicas_to_aggregate": t.replicas_to_aggregate,
        "total_num_replicas": t.total_num_replicas,
        "seed": t.seed,
        "checkpoint_every": t.checkpoint_every,
        "run_dir": run_dir,
        "startup_timeout": t.startup_timeout,
    }
    # JSON scalars (strings, integers, floats, booleans) are valid TOML scalars.
    lines = ["[cluster]", *(f"{k} = {json.dumps(v)}" for k, v in cluster.items()), ""]
    lines += ["[train]", *(f"{k} = {json.dumps(v)}" for k, v in train.items())]
    return "\n".join(lines) + "\n"


def write_output(text: str, output: str) -> None:
    """Print `text`, or write it to `output` whole (temporary file, then rename)."""
    if not output:
        print(text, end="")
        return
    path = Path(output)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
