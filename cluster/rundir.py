"""The run directory: layout, cluster.json, and whether an existing one may be resumed."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cluster import __version__
from cluster.config import ClusterConfig, ConfigError, TrainConfig
from cluster.plan import cluster_spec

# Fields that decide the result step by step: a run dir may only be resumed with the same values.
RESULT_FIELDS = (
    "job",
    "global_batch_size",
    "replicas_to_aggregate",
    "total_num_replicas",
    "seed",
    "shuffle",
    "on_nonfinite",
)


def default_run_dir(job: str, now: float | None = None) -> str:
    name = job.replace(":", ".").rsplit(".", 1)[-1]
    return str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}")


def describe(mode: str, train: TrainConfig, cluster: ClusterConfig | None) -> dict[str, Any]:
    """What cluster.json records: the resolved cluster and training settings."""
    return {
        "pstrain": __version__,
        "python": platform.python_version(),
        "mode": mode,
        "cluster": cluster_spec(cluster) if cluster else None,
        "control": cluster.control if cluster else None,
        "worker_gpus": list(cluster.worker_gpus) if cluster else None,
        "train": asdict(train),
    }


def check_compatible(previous: dict[str, Any], train: TrainConfig) -> None:
    """Refuse to resume a run dir that a config with different result-deciding settings wrote."""
    old = previous.get("train", {})
    for name in RESULT_FIELDS:
        if name in old and old[name] != getattr(train, name):
            raise ConfigError(
                f"--run-dir: {train.run_dir} was written with {name}={old[name]!r}, not {getattr(train, name)!r}; "
                "use the same settings to resume, or a new --run-dir"
            )


def prepare(run_dir: Path, record: dict[str, Any], train: TrainConfig) -> None:
    """Create the layout and write cluster.json, after checking any earlier run there."""
    path = run_dir / "cluster.json"
    if path.exists():
        try:
            previous = json.loads(path.read_text())
        except ValueError:
            raise ConfigError(f"--run-dir: {path} is not valid JSON; use a new --run-dir") from None
        check_compatible(previous, train)
    for sub in ("logs", "checkpoints"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


def write_secret(path: Path, secret: str) -> None:
    """A file only its owner can read (the generated control-plane token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


def checkpoint_step(state_text: str) -> int | None:
    """The step of the latest checkpoint a `checkpoints/checkpoint` state file names (None: none). Pure."""
    import re

    found = re.search(r'^model_checkpoint_path: "(?:.*/)?ckpt-(\d+)"', state_text, re.M)
    return int(found.group(1)) if found else None


def latest_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's latest complete checkpoint, read without TensorFlow; None when there is none."""
    try:
        return checkpoint_step((run_dir / "checkpoints" / "checkpoint").read_text())
    except OSError:
        return None


def load_train(run_dir: Path) -> TrainConfig:
    record = json.loads((run_dir / "cluster.json").read_text())
    return TrainConfig(**record["train"])
