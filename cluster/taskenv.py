"""The environment a launcher, node, Slurm step or pod hands a task: every `PSTRAIN_*` variable a task
reads, its default stated once, and the task-side helpers that act on it. Standard library and
cluster.config only, so that every role (chief, ps, worker) may import it.

docs/environment.md lists every variable; `TaskEnv.to_env()` writes those a task is handed,
`TaskEnv.from_env()` (with `env_token`, `env_control`, `token_in_env`) reads them, `Switches.from_env()`
reads those a user sets, `gpu_visibility()` reads CUDA_VISIBLE_DEVICES, and nothing else in the product
reads them by name (tests/test_owners.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cluster.config import ClusterConfig, Config, TrainConfig

DEFAULT_CONTROL_PORT = 2229  # `pstrain task` / `render tfjob`: the control plane's port on the chief's host

CONTROL_ENV = "PSTRAIN_CONTROL"
INTERVAL_ENV = "PSTRAIN_HEARTBEAT_INTERVAL"
TIMEOUT_ENV = "PSTRAIN_HEARTBEAT_TIMEOUT"
REGISTER_ENV = "PSTRAIN_REGISTER_TIMEOUT"
TOKEN_ENV = "PSTRAIN_TOKEN"
TLS_CA_ENV = "PSTRAIN_TLS_CA"
PARENT_ENV = "PSTRAIN_PARENT_PID"
READY_ENV = "PSTRAIN_READY_FILE"  # the chief connects to the cluster once this file exists
TTY_ENV = "PSTRAIN_TTY"
GPU_MEMORY_ENV = "PSTRAIN_GPU_MEMORY_MB"  # a worker's GPU memory limit (cluster/task_setup.py gpu_env)
START_TURNS_ENV = "PSTRAIN_START_TURNS"  # a server beside the chief: it loads in turns (worker/start_turns.py)
# Switches a user sets (no launcher hands them on): Switches.
READ_AHEAD_ENV = "PSTRAIN_READ_AHEAD"
LOG_PLACEMENT_ENV = "PSTRAIN_LOG_DEVICE_PLACEMENT"
RUN_DIR_ENV = "PSTRAIN_RUN_DIR"
DATA_DIR_ENV = "PSTRAIN_DATA_DIR"
CUDA_ENV = "CUDA_VISIBLE_DEVICES"  # the GPUs a task may see: set by the launcher (cluster/task_setup.py gpu_env)
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class TaskEnv:
    """What a task learns from its environment. Empty/None fields are not written by `to_env`."""

    control: str = ""  # the control plane to register with; "" runs without one (standalone)
    heartbeat_interval: float = ClusterConfig.heartbeat_interval
    heartbeat_timeout: float = ClusterConfig.heartbeat_timeout
    register_timeout: float = TrainConfig.startup_timeout  # how long a ps/worker retries registering
    token: str = ""
    tls_ca: str = ""  # PEM the task trusts when the control plane speaks TLS
    parent_pid: int | None = None  # the supervisor: the task dies with it (Linux)
    ready_file: str = ""  # the chief only: connect to the cluster once this file exists
    tty: bool = False  # the chief only: the launcher's stdout is a terminal (a redrawn progress bar)
    gpu_memory_mb: str = ""  # a worker on a shared GPU: its server's limit in MiB (worker/server.py checks it)
    start_turns: bool = False  # a server on the chief's machine: it loads TensorFlow in turns (worker/start_turns.py)

    @classmethod
    def for_config(cls, config: Config, token: str, tls_ca: str = "") -> TaskEnv:
        """The environment every path (launch, node, Slurm, pod) hands a ps or worker of `config`."""
        cluster = config.cluster
        return cls(
            control=cluster.control,
            heartbeat_interval=cluster.heartbeat_interval,
            heartbeat_timeout=cluster.heartbeat_timeout,
            register_timeout=config.train.startup_timeout,
            token=token,
            tls_ca=tls_ca,
        )

    def to_env(self) -> dict[str, str]:
        env = {}
        if self.control:
            env.update(
                {
                    CONTROL_ENV: self.control,
                    INTERVAL_ENV: str(self.heartbeat_interval),
                    TIMEOUT_ENV: str(self.heartbeat_timeout),
                    REGISTER_ENV: str(self.register_timeout),
                    TOKEN_ENV: self.token,
                }
            )
        if self.tls_ca:
            env[TLS_CA_ENV] = self.tls_ca
        if self.parent_pid is not None:
            env[PARENT_ENV] = str(self.parent_pid)
        if self.ready_file:
            env[READY_ENV] = self.ready_file
        if self.tty:
            env[TTY_ENV] = "1"
        if self.gpu_memory_mb:
            env[GPU_MEMORY_ENV] = self.gpu_memory_mb
        if self.start_turns:
            env[START_TURNS_ENV] = "1"
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TaskEnv:
        env = os.environ if env is None else env
        parent = env.get(PARENT_ENV, "")
        defaults = cls()
        return cls(
            control=env_control(env),
            heartbeat_interval=float(env.get(INTERVAL_ENV) or defaults.heartbeat_interval),
            heartbeat_timeout=float(env.get(TIMEOUT_ENV) or defaults.heartbeat_timeout),
            register_timeout=float(env.get(REGISTER_ENV) or defaults.register_timeout),
            token=env_token(env),
            tls_ca=env.get(TLS_CA_ENV, ""),
            parent_pid=int(parent) if parent else None,
            ready_file=env.get(READY_ENV, ""),
            tty=env.get(TTY_ENV) == "1",
            gpu_memory_mb=env.get(GPU_MEMORY_ENV, ""),
            start_turns=env.get(START_TURNS_ENV) == "1",
        )


def env_token(env: Mapping[str, str] | None = None) -> str:
    """$PSTRAIN_TOKEN, stripped ("" when unset)."""
    return (os.environ if env is None else env).get(TOKEN_ENV, "").strip()


def token_in_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether $PSTRAIN_TOKEN is set at all (a token the user manages, even an empty one)."""
    return TOKEN_ENV in (os.environ if env is None else env)


def env_control(env: Mapping[str, str] | None = None) -> str:
    """$PSTRAIN_CONTROL, the control plane to register with ("" when unset)."""
    return (os.environ if env is None else env).get(CONTROL_ENV, "")


def default_data_dir() -> Path:
    return Path.home() / ".cache" / "pstrain"


@dataclass(frozen=True)
class Switches:
    """The `PSTRAIN_*` switches a user sets for one process (docs/environment.md), read in one place."""

    read_ahead: bool = True  # PSTRAIN_READ_AHEAD=0: workers do not read a file source's next batch ahead
    log_device_placement: bool = False  # PSTRAIN_LOG_DEVICE_PLACEMENT=1: the chief logs each op's device
    run_dir: str = ""  # PSTRAIN_RUN_DIR: an evaluator task's run directory, where --run-dir is not given
    data_dir: Path = field(default_factory=default_data_dir)  # PSTRAIN_DATA_DIR: the example jobs' downloads

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Switches:
        env = os.environ if env is None else env
        return cls(
            read_ahead=env.get(READ_AHEAD_ENV, "1") != "0",
            log_device_placement=env.get(LOG_PLACEMENT_ENV) == "1",
            run_dir=env.get(RUN_DIR_ENV, ""),
            data_dir=Path(env.get(DATA_DIR_ENV, default_data_dir())).expanduser(),
        )


def gpu_visibility(env: Mapping[str, str] | None = None) -> str | None:
    """CUDA_VISIBLE_DEVICES as this process (or `env`) has it: None where unset (every GPU visible), ""
    where none is. Its only reader (tests/test_owners.py); an entry point reads it and passes it on."""
    return (os.environ if env is None else env).get(CUDA_ENV)


def wait_until_ready(timeout_s: float, stopped: Callable[[], bool] = lambda: False) -> bool:
    """Block until the file named in $PSTRAIN_READY_FILE exists (at once when it is not set); False
    after `timeout_s` or once `stopped()`. The launcher creates it once every ps and worker registered."""
    path = TaskEnv.from_env().ready_file
    deadline = time.monotonic() + timeout_s
    while path and not os.path.exists(path):
        if time.monotonic() > deadline or stopped():
            return False
        time.sleep(0.05)
    return True


def die_with_parent() -> None:
    """SIGKILL this process when the supervisor named in $PSTRAIN_PARENT_PID dies (Linux).

    Done in the task rather than in a `preexec_fn`, which keeps Python code out of the window between
    fork() and exec() in the launcher, which runs gRPC threads (see cluster/cli.py)."""
    parent = TaskEnv.from_env().parent_pid
    if parent is None:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the supervisor died before we got here
        os._exit(1)
