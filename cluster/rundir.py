"""The run directory: its layout (`RunDir`), the config record (cluster.json), metrics.jsonl as read back,
and whether an existing one may be resumed. Every reader and writer of a run directory takes its paths
here (tests/test_owners.py refuses a `run_dir /` join elsewhere); metrics.jsonl and cluster.json are parsed
nowhere else. A RunDir is made where a run dir enters a process (`python -m chief`, `pstrain`) and passed
down: the helpers here take it, not a path to wrap again.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster import __version__
from cluster.config import ClusterConfig, ConfigError, TrainConfig
from cluster.task_setup import cluster_spec

LOCK_NAME = "pstrain.lock"  # cluster/runlock.py: one run per run dir

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


@dataclass(frozen=True)
class RunDir:
    """A run directory: where each file of a run lives, and the files read back. Made from a path or the
    config's `train.run_dir` text alike."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def resolved(self) -> RunDir:
        """The same run dir by its absolute path, symlinks resolved (the same path on every node)."""
        return RunDir(self.path.resolve())

    @property
    def config_record(self) -> Path:
        """cluster.json: the resolved cluster and [train] settings (`describe`), written by `prepare`."""
        return self.path / "cluster.json"

    @property
    def metrics(self) -> Path:
        """metrics.jsonl: one JSON line per step, eval lines, then a "done" line (chief/metrics.py writes it)."""
        return self.path / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def log(self, task_name: str) -> Path:
        """A task's log, e.g. `log("worker-0")`."""
        return self.logs / f"{task_name}.log"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def checkpoint_state(self) -> Path:
        """checkpoints/checkpoint: TF's state file naming the latest checkpoint and those kept."""
        return self.checkpoints / CHECKPOINT_STATE

    @property
    def evaluations(self) -> Path:
        """eval.jsonl: the sidecar evaluator's line per checkpoint (chief/sidecar.py)."""
        return self.path / "eval.jsonl"

    @property
    def adapted(self) -> Path:
        """adapted.json: a digest of each preprocessing layer `model_fn` adapts, from the run's first start."""
        return self.path / "adapted.json"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def plots(self) -> Path:
        return self.path / "plots"

    @property
    def saved_model(self) -> Path:
        """The trained model as a SavedModel (chief/export.py), written at the end of the run."""
        return self.path / "saved_model"

    @property
    def stream_record(self) -> Path:
        """stream.json: a stream's slot batch and epoch length, once learnt (worker/input/streams.py)."""
        return self.path / "stream.json"

    @property
    def data(self) -> Path:
        """data/: `train_data()` arrays written as .npy files for the workers (worker/input/tables.py)."""
        return self.path / "data"

    @property
    def evaluator_copy(self) -> RunDir:
        """A run dir inside data/ for `pstrain evaluate`: its own copy of `train_data()` arrays goes to
        data/data, apart from the workers' (data/*.npy)."""
        return RunDir(self.data)

    @property
    def lock(self) -> Path:
        """pstrain.lock: the live run's holder (cluster/runlock.py)."""
        return self.path / LOCK_NAME

    @property
    def starts(self) -> Path:
        """starts.jsonl: a line per launch and per start of the chief (`note_start`; cluster/run_times.py reads it)."""
        return self.path / "starts.jsonl"

    @property
    def control_token(self) -> Path:
        """The generated control-plane token (owner-only)."""
        return self.path / "control.token"

    def token_file(self, record: ControlRecord) -> Path:
        """The token file `record` names (a relative name: in this run dir)."""
        return self.path / record.token_file

    @property
    def stop_cause(self) -> Path:
        """logs/stop-cause: what asked the live launch to stop ("pstrain stop from HOST"), written by the
        launcher before it signals the chief, so the chief's stop line names it; removed when the launch ends."""
        return self.logs / "stop-cause"

    @property
    def control_record(self) -> Path:
        """control.json: where the live run's control plane answers (`ControlRecord`); `pstrain status
        --run-dir` reads it. Written when the launcher's control plane starts, removed when the launch ends."""
        return self.path / "control.json"

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every record of metrics.jsonl in order ([] when there is none yet); a line cut short by a crash is skipped."""
        return read_records(self.metrics)

    def is_done(self) -> bool:
        """Whether the run wrote its "done" line."""
        return any(record.get("event") == "done" for record in self.read_metrics())

    def record(self) -> dict[str, Any]:
        """cluster.json as written (OSError when missing, ValueError when not JSON)."""
        return json.loads(self.config_record.read_text())

    def train(self) -> TrainConfig:
        """The [train] settings the run was started with."""
        return TrainConfig(**self.record()["train"])


@dataclass(frozen=True)
class ControlRecord:
    """What `pstrain status|stop|doctor --run-dir DIR` needs to reach a live run's control plane."""

    target: str  # a gRPC target: "HOST:PORT", or "unix:PATH"
    engine: str  # who launched it: "local", "ray", "slurm", "tfjob"
    token_file: str  # the token's file, relative to the run dir or absolute; "" where $PSTRAIN_TOKEN gave it
    tls_ca: str = ""  # the CA to trust where the control plane speaks TLS
    host: str = ""  # the launcher's host and pid
    pid: int = 0


def write_control(run_dir: RunDir, record: ControlRecord) -> None:
    """Write control.json whole (a reader never sees half of it)."""
    path = run_dir.control_record
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record), indent=2) + "\n")
    tmp.replace(path)


def remove_control(run_dir: RunDir, record: ControlRecord) -> None:
    """Remove control.json when it is still `record`'s (a later launch may have written its own)."""
    try:
        if read_control(run_dir) == record:
            run_dir.control_record.unlink(missing_ok=True)
    except (ConfigError, OSError):
        pass


def read_control(run_dir: RunDir) -> ControlRecord:
    """control.json of `run_dir`; ConfigError (one line) when there is none or it does not parse."""
    path = run_dir.control_record
    if not run_dir.path.is_dir():
        raise ConfigError(f"--run-dir: {run_dir.path} is not a directory; give the --run-dir of a running pstrain launch")
    try:
        data = json.loads(path.read_text())
        return ControlRecord(**{k: data[k] for k in ("target", "engine", "token_file")}, **_optional(data))
    except FileNotFoundError:
        raise ConfigError(
            f"--run-dir: {run_dir.path} has no control.json: no pstrain launch is serving a control plane there "
            "(it ended, or the run is standalone); start one with: pstrain launch --run-dir " + str(run_dir.path)
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--run-dir: cannot read {path} ({e}); give the --run-dir of a running pstrain launch") from None


def _optional(data: dict[str, Any]) -> dict[str, Any]:
    return {k: data[k] for k in ("tls_ca", "host", "pid") if k in data}


def write_stop_cause(run_dir: RunDir, cause: str) -> None:
    run_dir.stop_cause.write_text(cause + "\n")


def read_stop_cause(run_dir: RunDir) -> str:
    """The cause the launcher wrote ("" when none: a stop by a signal, or no launcher)."""
    try:
        return run_dir.stop_cause.read_text().strip()
    except OSError:
        return ""


def latest_step(run_dir: RunDir) -> tuple[int, float] | None:
    """(steps done, wall time at the end of that step's block) from the newest step line of metrics.jsonl
    (whose "step" counts from 0); None before the first step."""
    for record in reversed(run_dir.read_metrics()):
        if "event" not in record and "step" in record and "time" in record:
            return int(record["step"]) + 1, float(record["time"])
    return None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file ([] when it does not exist); lines that do not parse (cut
    short by a crash) are skipped."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


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
        "allow_open_ports": cluster.allow_open_ports if cluster else None,  # TF ports open where not closable
        "private_network": cluster.private_network if cluster else None,  # false: a local cluster's TF ports open
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


def check_earlier_run(layout: RunDir, train: TrainConfig) -> None:
    """ConfigError (one line) when `layout` holds an earlier run written with other result-deciding
    settings: a launch asks this before it starts anything, and `prepare` again under the run dir's lock."""
    path = layout.config_record
    if path.exists():
        try:
            previous = json.loads(path.read_text())
        except ValueError:
            raise ConfigError(f"--run-dir: {path} is not valid JSON; use a new --run-dir") from None
        check_compatible(previous, train)


def prepare(layout: RunDir, record: dict[str, Any], train: TrainConfig) -> None:
    """Create the layout and write cluster.json, after checking any earlier run there."""
    path = layout.config_record
    check_earlier_run(layout, train)
    for sub in (layout.logs, layout.checkpoints):
        sub.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    note_start(layout, "launch")


def note_start(run_dir: RunDir, event: str, now: float | None = None) -> None:
    """Append a start record ("launch" or "chief") to RUN_DIR/starts.jsonl: how `done in` counts from
    the first launch and counts restarts."""
    with open(run_dir.starts, "a") as f:
        f.write(json.dumps({"event": event, "time": round(time.time() if now is None else now, 3)}) + "\n")


def write_secret(path: Path, secret: str) -> None:
    """A file only its owner can read (the generated control-plane token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


# Checkpoint names: checkpoint N of a run is the prefix `checkpoints/ckpt-N` (files `ckpt-N.index` and
# `ckpt-N.data-K-of-M`; a write in progress `ckpt-N_temp`), listed in the state file `checkpoints/checkpoint`
# as TF's checkpoint_management writes it. Only this module builds or parses the name (tests/test_owners.py).
CHECKPOINT_STATE = "checkpoint"
_INDEX = re.compile(r"ckpt-(\d+)\.index")
_DATA = re.compile(r"(ckpt-\d+)\.data-\d+-of-\d+")


def checkpoint_name(step: int) -> str:
    """The prefix's name of checkpoint `step` in checkpoints/ (TF adds `.index`, `.data-*`). Pure."""
    return f"ckpt-{step}"


def checkpoint_step(state_text: str) -> int | None:
    """The step of the latest checkpoint a `checkpoints/checkpoint` state file names (None: none). Pure."""
    found = re.search(r'^model_checkpoint_path: "(?:.*/)?ckpt-(\d+)"', state_text, re.M)
    return int(found.group(1)) if found else None


def checkpoint_prefixes(directory: Path) -> list[Path]:
    """Every complete checkpoint's prefix (its index written) in the checkpoints `directory`, oldest first."""
    found = [(int(m.group(1)), p) for p in directory.glob("ckpt-*.index") if (m := _INDEX.fullmatch(p.name))]
    return [p.with_suffix("") for _, p in sorted(found)]


def partial_saves(directory: Path) -> list[Path]:
    """What an interrupted save left in the checkpoints `directory`: `ckpt-N_temp` files and directories,
    and data files whose index was never written."""
    data = [(p, m.group(1)) for p in directory.glob("ckpt-*.data-*") if (m := _DATA.fullmatch(p.name))]
    unindexed = [p for p, prefix in data if not (directory / f"{prefix}.index").exists()]
    return sorted([*directory.glob("*_temp*"), *unindexed])


def newest_checkpoint_bytes(*directories: Path) -> int:
    """The size of the newest complete checkpoint (by its index's time) in any of the checkpoints
    `directories`: its index and data files; 0 when there is none."""
    try:
        indexes = [p for d in directories for p in d.glob("ckpt-*.index") if _INDEX.fullmatch(p.name)]
        if not indexes:
            return 0
        newest = max(indexes, key=lambda p: p.stat().st_mtime)
        return sum(p.stat().st_size for p in newest.parent.glob(newest.name.removesuffix(".index") + ".*"))
    except OSError:  # a checkpoint deleted (MAX_TO_KEEP) between the listing and its stat
        return 0


def checkpoint_bytes_within(path: Path) -> int:
    """`newest_checkpoint_bytes` of the run dir `path` and of the run dirs directly inside it (`runs/`)."""
    return newest_checkpoint_bytes(*(RunDir(p).checkpoints for p in (path, *path.glob("*/"))))


def latest_checkpoint_step(run_dir: RunDir) -> int | None:
    """The step of the run's latest complete checkpoint, read without TensorFlow; None when there is none."""
    try:
        return checkpoint_step(run_dir.checkpoint_state.read_text())
    except OSError:
        return None


def checkpoint_progress(run_dir: RunDir) -> tuple[tuple[str, int], ...]:
    """The names and sizes of RUN_DIR/checkpoints' files, with those inside a write's `ckpt-N_temp`
    directory: a write in progress grows them, a finished one renames them and adds its index. Two
    looks that differ show the write progressed."""
    found: list[tuple[str, int]] = []
    try:
        for path in run_dir.checkpoints.iterdir():
            inside = list(path.iterdir()) if path.is_dir() else [path]
            found += [(f"{path.name}/{f.name}", f.stat().st_size) for f in inside]
    except OSError:  # no directory yet; or a file renamed between the listing and its stat: a change
        found.append(("", -1))
    return tuple(sorted(found))
