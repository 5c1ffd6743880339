"""The cluster config: one TOML file, command-line overrides, validation into frozen dataclasses.

Pure logic only (no sockets, no processes): every invalid field raises ``ConfigError`` with a
one-line message naming the field and the fix.
"""

from __future__ import annotations

import difflib
import importlib.util
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from cluster.errors import ConfigError

__all__ = ["ConfigError"]  # re-exported: the config's own error

DEFAULT_HOST = "127.0.0.1"
DEFAULT_JOB = "chief.jobs.digits"
AUTO = "auto"
EPOCH = "epoch"  # train.eval_every / checkpoint_every: at every epoch's end (with train.epochs)


@dataclass(frozen=True)
class ClusterConfig:
    """Where each task runs. Port 0 means "pick a free port" (only on this machine)."""

    chief: str = f"{DEFAULT_HOST}:0"
    ps: tuple[str, ...] = (f"{DEFAULT_HOST}:0",)
    workers: tuple[str, ...] = (f"{DEFAULT_HOST}:0", f"{DEFAULT_HOST}:0")
    # GPU index per worker (None: no GPU); "auto" shares the GPUs round-robin (worker i on GPU i mod
    # the count; all on the CPU where there is none). A mix of GPU and CPU workers only by index.
    worker_gpus: tuple[int | None, ...] = (None, None)
    worker_gpu_memory_mb: int = 0  # per worker on a GPU: a memory limit in MiB; 0: memory growth where shared
    chief_gpus: str = ""  # CUDA_VISIBLE_DEVICES for the chief; empty = no GPU
    ps_gpus: str = ""  # CUDA_VISIBLE_DEVICES for every ps task; empty = no GPU
    control: str = f"{DEFAULT_HOST}:0"  # the control plane (served by the chief's launcher)
    heartbeat_interval: float = 2.0
    heartbeat_timeout: float = 10.0  # a task silent this long is "lost"; a node without its chief stops
    token_file: str = ""  # shared control-plane token; else $PSTRAIN_TOKEN; else a fresh one (one machine)
    tls_cert: str = ""  # PEM certificate and key: the control plane speaks TLS
    tls_key: str = ""
    tls_ca: str = ""  # the CA that clients trust (default: tls_cert, for a self-signed certificate)
    max_restarts: int = 3  # per task and per restart_window: a crashed ps, worker or chief is restarted this often
    restart_window: float = 600.0  # seconds: a restart stops counting against max_restarts this long after it
    engine: str = "local"  # who places the tasks: "local" (pstrain launch/node) or "ray" (docs/ray.md)
    ray_address: str = ""  # engine "ray": "" starts a local Ray on 127.0.0.1; "auto" or HOST:PORT joins one
    spread_workers: bool = False  # engine "ray": every worker on a node of its own (STRICT_SPREAD)
    allow_open_ports: bool = False  # run even where the TF ports cannot be closed (cluster/doors.py)
    private_network: bool = True  # a local cluster's tasks in a private network namespace; false: open, needs the above


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how; the fields of the ``[train]`` section."""

    job: str = DEFAULT_JOB
    steps: int = 300  # with `epochs`: set by the chief from the data's length (chief/epochs.py)
    epochs: int = 0  # passes over the training set (0: train `steps`); Keras's fit(epochs=...)
    global_batch_size: int = 64
    replicas_to_aggregate: int = 0  # 0: the number of workers
    total_num_replicas: int = 0  # 0: replicas_to_aggregate (no backup workers)
    seed: int = 0
    checkpoint_every: int | str = 100  # K steps, or "epoch" (with epochs)
    eval_every: int | str = 0  # evaluate on eval_data() every K steps (0: only at the end), or "epoch"
    run_dir: str = ""  # empty: runs/<job>-<timestamp>
    startup_timeout: float = 60.0  # seconds to wait for every TF server to accept connections
    shuffle: str = "permutation"  # data order: "permutation" (NumPy, O(N)) or "index_shuffle" (stateless, O(batch))
    steps_per_execution: int = 64  # K: steps each closure runs per dispatch (blocks end at checkpoints and evaluations)
    on_nonfinite: str = "stop"  # a NaN/Inf loss, mean gradient or state delta: "stop" (checkpoint, exit) or "skip" the step
    dense: str = "ps"  # dense variables: "ps" (applied on the ps) or "allreduce" (replicated on the workers: the hybrid step)

    @property
    def slot_batch_size(self) -> int:
        """Examples behind each aggregated gradient."""
        return self.global_batch_size // self.replicas_to_aggregate


@dataclass(frozen=True)
class Config:
    cluster: ClusterConfig
    train: TrainConfig


# `host` is a [cluster] field of the file that is not kept: tasks given by count are placed on it.
STRING_FIELDS = ("chief_gpus", "ps_gpus", "token_file", "tls_cert", "tls_key", "tls_ca")  # taken as given
CLUSTER_FIELDS = ("host", *(f.name for f in fields(ClusterConfig)))
TRAIN_FIELDS = tuple(f.name for f in fields(TrainConfig))
SECTIONS = {"cluster": CLUSTER_FIELDS, "train": TRAIN_FIELDS}


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a config file; a missing or malformed file is a ConfigError."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config: file {path} not found; pass the path of a TOML config") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: {path} is not valid TOML ({e}); fix the syntax") from None


def _check_known(section: str, table: dict[str, Any], known: tuple[str, ...]) -> None:
    for key in table:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean '{near[0]}'?" if near else f"known fields: {', '.join(known)}"
            raise ConfigError(f"[{section}] {key}: unknown field; {hint}")


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value}")
    return value


def parse_address(name: str, address: Any) -> tuple[str, int]:
    """'host:port' -> (host, port); brackets allowed around IPv6 hosts."""
    if not isinstance(address, str) or ":" not in address:
        raise ConfigError(f"{name}: expected 'host:port', got {address!r}")
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{name}: expected 'host:port' with a port 0-65535, got {address!r}")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _addresses(name: str, value: Any, host: str) -> tuple[str, ...]:
    """A task list is either a count (free ports on `host`) or a list of 'host:port'."""
    if isinstance(value, int) and not isinstance(value, bool):
        count = _int(name, value, 1)
        return tuple(format_address(host, 0) for _ in range(count))
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{name}: expected a count or a non-empty list of 'host:port', got {value!r}")
    for i, address in enumerate(value):
        parse_address(f"{name}[{i}]", address)
    return tuple(value)


def _worker_gpus(value: Any, count: int, gpu_count: int) -> tuple[int | None, ...]:
    """ "auto": worker i on GPU i mod `gpu_count` (workers share GPUs round-robin, never a GPU and CPU
    mix), all on the CPU without GPUs; else the list as given, -1 for a worker on the CPU."""
    if value == AUTO:
        return tuple(i % gpu_count if gpu_count else None for i in range(count))
    if not isinstance(value, list) or len(value) != count:
        raise ConfigError(f'cluster.worker_gpus: expected "auto" or a list of {count} GPU indices (-1 for none), got {value!r}')
    gpus = []
    for i, gpu in enumerate(value):
        _int(f"cluster.worker_gpus[{i}]", gpu, -1)
        gpus.append(None if gpu < 0 else gpu)
    return tuple(gpus)


def resolve(raw: dict[str, Any], overrides: dict[str, Any] | None = None, gpu_count: int = 0) -> Config:
    """Validate a parsed TOML document plus flag overrides into a Config.

    `overrides` maps flag names (``workers``, ``ps``, ``host`` and every TrainConfig field) to values;
    None values are ignored. `gpu_count` is the number of GPUs on this machine, used for "auto" GPUs
    and to reject indices that do not exist here.
    """
    for section in raw:
        if section not in SECTIONS:
            near = difflib.get_close_matches(section, SECTIONS, n=1)
            hint = f"did you mean [{near[0]}]?" if near else "the sections are [cluster] and [train]"
            raise ConfigError(f"[{section}]: unknown section; {hint}")
    cluster_raw = dict(raw.get("cluster", {}))
    train_raw = dict(raw.get("train", {}))
    for section, table in (("cluster", cluster_raw), ("train", train_raw)):
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}]: expected a table of fields")
        _check_known(section, table, SECTIONS[section])
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        (cluster_raw if key in CLUSTER_FIELDS else train_raw)[key] = value
    cluster = _resolve_cluster(cluster_raw, gpu_count)
    train = _resolve_train(train_raw, len(cluster.workers))
    return Config(cluster=cluster, train=train)


def _resolve_cluster(raw: dict[str, Any], gpu_count: int) -> ClusterConfig:
    defaults = ClusterConfig()
    host = raw.get("host", DEFAULT_HOST)
    if not isinstance(host, str) or not host:
        raise ConfigError(f"cluster.host: expected a host name or address, got {host!r}")
    chief = raw.get("chief", format_address(host, 0))
    parse_address("cluster.chief", chief)
    ps = _addresses("cluster.ps", raw.get("ps", len(defaults.ps)), host)
    workers = _addresses("cluster.workers", raw.get("workers", len(defaults.workers)), host)
    gpus = _worker_gpus(raw.get("worker_gpus", AUTO), len(workers), gpu_count)
    for i, gpu in enumerate(gpus):
        worker_host = parse_address("cluster.workers", workers[i])[0]
        if gpu is not None and is_local_host(worker_host) and gpu >= gpu_count:
            have = f"it has {gpu_count}" if gpu_count else "it has none"
            raise ConfigError(
                f"cluster.worker_gpus[{i}]: GPU {gpu} does not exist on this machine ({have}); "
                'use an index below that, -1 for no GPU, or "auto"'
            )
    strings = {name: raw.get(name, getattr(defaults, name)) for name in STRING_FIELDS}
    for name, value in strings.items():
        if not isinstance(value, str):
            expected = 'a CUDA_VISIBLE_DEVICES string such as "0" or ""' if name.endswith("_gpus") else "a file path"
            raise ConfigError(f"cluster.{name}: expected {expected}")
    chief_host = parse_address("cluster.chief", chief)[0]
    control = raw.get("control", format_address(chief_host, 0))
    parse_address("cluster.control", control)
    interval = _seconds("cluster.heartbeat_interval", raw.get("heartbeat_interval", defaults.heartbeat_interval))
    timeout = _seconds("cluster.heartbeat_timeout", raw.get("heartbeat_timeout", defaults.heartbeat_timeout))
    if timeout <= interval:
        raise ConfigError(
            f"cluster.heartbeat_timeout: {timeout:g}s must exceed heartbeat_interval ({interval:g}s); use several intervals"
        )
    cluster = ClusterConfig(
        chief=chief,
        ps=ps,
        workers=workers,
        worker_gpus=gpus,
        control=control,
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        max_restarts=_int("cluster.max_restarts", raw.get("max_restarts", defaults.max_restarts), 0),
        worker_gpu_memory_mb=_int("cluster.worker_gpu_memory_mb", raw.get("worker_gpu_memory_mb", 0), 0),
        **_engine(raw),
        restart_window=_seconds("cluster.restart_window", raw.get("restart_window", defaults.restart_window)),
        allow_open_ports=_bool("cluster.allow_open_ports", raw.get("allow_open_ports", False)),
        private_network=_bool("cluster.private_network", raw.get("private_network", True)),
        **strings,
    )
    check_unique_addresses(cluster)
    return cluster


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    return value


def _engine(raw: dict[str, Any]) -> dict[str, Any]:
    """The engine fields: `engine`, `ray_address` ("", "auto" or HOST:PORT) and `spread_workers`."""
    engine = raw.get("engine", "local")
    if engine not in ("local", "ray"):
        raise ConfigError(f'cluster.engine: expected "local" or "ray" (docs/ray.md), got {engine!r}')
    address = raw.get("ray_address", "")
    if not isinstance(address, str):
        raise ConfigError(f'cluster.ray_address: expected "auto" or "HOST:PORT", got {address!r}')
    if address not in ("", AUTO):
        parse_address("cluster.ray_address", address)
    spread = _bool("cluster.spread_workers", raw.get("spread_workers", False))
    if engine != "ray" and (address or spread):
        name = "ray_address" if address else "spread_workers"
        raise ConfigError(f'cluster.{name}: applies to engine = "ray" only; set engine = "ray" or remove it')
    return {"engine": engine, "ray_address": address, "spread_workers": spread}


def check_unique_addresses(cluster: ClusterConfig) -> None:
    """Two tasks may not share a host:port (port 0 is resolved later, so it never clashes)."""
    seen: dict[tuple[str, int], str] = {}
    for name, address in task_addresses(cluster):
        key = parse_address(name, address)
        if key[1] == 0:
            continue
        if key in seen:
            raise ConfigError(f"{name}: address {address} is also used by {seen[key]}; give each task its own port")
        seen[key] = name


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{name}: expected seconds > 0, got {value!r}")
    return float(value)


def task_addresses(cluster: ClusterConfig) -> list[tuple[str, str]]:
    """(config field name, address) of every task and the control plane, chief first."""
    named = [("cluster.chief", cluster.chief), ("cluster.control", cluster.control)]
    named += [(f"cluster.ps[{i}]", a) for i, a in enumerate(cluster.ps)]
    named += [(f"cluster.workers[{i}]", a) for i, a in enumerate(cluster.workers)]
    return named


def _resolve_train(raw: dict[str, Any], num_workers: int) -> TrainConfig:
    defaults = TrainConfig()
    job = raw.get("job", defaults.job)
    if not isinstance(job, str) or not job.strip():
        raise ConfigError(f"train.job: expected 'package.module' or 'package.module:attr', got {job!r}")
    steps = _int("train.steps", raw.get("steps", defaults.steps), 1)
    epochs = _int("train.epochs", raw.get("epochs", 0), 0)
    if epochs and "steps" in raw:
        raise ConfigError("train.steps and train.epochs: give one of them (--steps N or --epochs N), not both")
    batch = _int("train.global_batch_size", raw.get("global_batch_size", defaults.global_batch_size), 1)
    replicas = (
        _int("train.replicas_to_aggregate", raw.get("replicas_to_aggregate", defaults.replicas_to_aggregate), 0) or num_workers
    )
    total = _int("train.total_num_replicas", raw.get("total_num_replicas", defaults.total_num_replicas), 0) or replicas
    if replicas > total:
        raise ConfigError(
            f"train.replicas_to_aggregate: {replicas} is larger than train.total_num_replicas ({total}); "
            "aggregate at most as many gradients as are computed per step"
        )
    if batch % replicas:
        raise ConfigError(
            f"train.global_batch_size: {batch} does not split evenly over {replicas} aggregated gradients; "
            f"use a multiple of {replicas}"
        )
    seed = _int("train.seed", raw.get("seed", defaults.seed), 0)
    every = _every("train.checkpoint_every", raw.get("checkpoint_every", defaults.checkpoint_every), epochs)
    eval_every = _every("train.eval_every", raw.get("eval_every", defaults.eval_every), epochs)
    run_dir = raw.get("run_dir", defaults.run_dir)
    if not isinstance(run_dir, str):
        raise ConfigError(f"train.run_dir: expected a path, got {run_dir!r}")
    timeout = _seconds("train.startup_timeout", raw.get("startup_timeout", defaults.startup_timeout))
    shuffle = raw.get("shuffle", defaults.shuffle)
    if shuffle not in ("permutation", "index_shuffle"):
        raise ConfigError(
            f"train.shuffle: expected 'permutation' or 'index_shuffle' (stateless, for very large data sets), got {shuffle!r}"
        )
    per_execution = _int("train.steps_per_execution", raw.get("steps_per_execution", defaults.steps_per_execution), 1)
    nonfinite = raw.get("on_nonfinite", defaults.on_nonfinite)
    if nonfinite not in ("stop", "skip"):
        raise ConfigError(f"train.on_nonfinite: expected 'stop' or 'skip' (drop the step and go on), got {nonfinite!r}")
    dense = raw.get("dense", defaults.dense)
    if dense not in ("ps", "allreduce"):
        raise ConfigError(f"train.dense: expected 'ps' or 'allreduce' (dense variables replicated on the workers), got {dense!r}")
    return TrainConfig(
        job=job.strip(),
        steps=steps,
        epochs=epochs,
        global_batch_size=batch,
        replicas_to_aggregate=replicas,
        total_num_replicas=total,
        seed=seed,
        checkpoint_every=every,
        eval_every=eval_every,
        run_dir=run_dir,
        startup_timeout=float(timeout),
        shuffle=shuffle,
        steps_per_execution=per_execution,
        on_nonfinite=nonfinite,
        dense=dense,
    )


def _every(name: str, value: Any, epochs: int) -> int | str:
    """A step count >= 0, or "epoch" (training by epochs only)."""
    if value == EPOCH:
        if not epochs:
            raise ConfigError(f'{name}: "epoch" needs train.epochs (--epochs N); give a step count, or train by epochs')
        return EPOCH
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f'{name}: expected a step count or "epoch", got {value!r}')
    return _int(name, value, 0)


def every_flag(text: str) -> int | str:
    """--eval-every / --checkpoint-every: an integer or "epoch" (validated with the config)."""
    return EPOCH if text == EPOCH else int(text)


every_flag.__name__ = "K steps or 'epoch'"  # argparse's word for a value it refuses: "invalid K steps or 'epoch' value"


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def is_local_host(host: str, local_addresses: frozenset[str] = frozenset()) -> bool:
    """Loopback, or one of this machine's own addresses/names (passed in: this module does no I/O)."""
    return is_loopback(host) or host in local_addresses


def with_train(config: Config, **changes: Any) -> Config:
    return replace(config, train=replace(config.train, **changes))


def check_job_module(spec: str) -> None:
    """Fail before any process starts when the job's module cannot be found at all, or is a file's path."""
    module = spec.partition(":")[0]
    if module.endswith(".py") or "/" in module:
        dotted = module.removesuffix(".py").removeprefix("./").strip("/").replace("/", ".")
        raise ConfigError(
            f"train.job: {module!r} is a file path; give the module form, e.g. --job {dotted} "
            "(run from the directory that holds it)"
        )
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"train.job: module {module!r} not found; give an importable package.module (is it on PYTHONPATH?)")
