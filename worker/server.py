"""Start a `tf.distribute.Server` for the task that TF_CONFIG names and serve until SIGTERM/SIGINT."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import NoReturn

from cluster.control.agent import Refused, agent_from_env
from cluster.errors import ConfigError, PstrainError, report
from cluster.taskenv import TaskEnv, die_with_parent, gpu_visibility
from cluster.tfconfig import server_task, tf_config_text
from worker import tf_runtime
from worker.start_turns import start_turn

log = logging.getLogger("pstrain.server")


def leave(error: PstrainError) -> NoReturn:
    """Report `error` and exit with its code at once: a running TF server cannot be stopped in-process."""
    sys.stdout.flush()
    os._exit(report(error))


def gpu_memory_fn(tf: tf_runtime.Runtime) -> Callable[[], int]:
    """Bytes of GPU memory TensorFlow holds in this process (0 without a visible GPU)."""
    if not tf.list_physical_devices("GPU"):
        return lambda: 0
    return lambda: int(tf.get_memory_info("GPU:0")["current"])


def server_config(task: TaskEnv):
    """The server's ConfigProto: its one visible GPU limited to `task.gpu_memory_mb` MiB (workers that
    share a GPU, cluster.worker_gpu_memory_mb), or None (TensorFlow's default, or memory growth by
    TF_FORCE_GPU_ALLOW_GROWTH)."""
    text = task.gpu_memory_mb
    if not text:
        return None
    if not text.isdigit() or int(text) <= 0:
        raise ConfigError(f"PSTRAIN_GPU_MEMORY_MB: expected a positive number of MiB, got {text!r}")
    from tensorflow.core.protobuf import config_pb2

    config = config_pb2.ConfigProto()
    config.gpu_options.experimental.virtual_devices.add(memory_limit_mb=[float(text)])
    return config


def main() -> int:
    """Entry point of `pstrain server` and `python -m worker`: serve, or one error line and its exit code."""
    try:
        return serve()
    except PstrainError as e:
        return report(e)


def serve() -> int:
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    cluster, task_type, index = server_task(tf_config_text())
    # Block the stop signals first so that sigwait below receives them; TF's join() never returns.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    task = TaskEnv.from_env()
    waited = time.monotonic()
    with start_turn() if task.start_turns else contextlib.nullcontext(False) as turn:
        if task.start_turns:  # beside the chief, the servers load in turns: it keeps a core (worker/start_turns.py)
            how = "in its turn" if turn else "without a turn"
            log.info("%s:%d loading TensorFlow %s after %.2fs", task_type, index, how, time.monotonic() - waited)
        tf = tf_runtime.load()
        devices = [f"{d.device_type}:{d.name}" for d in tf.list_physical_devices()]
        log.info(
            "%s:%d pid %d CUDA_VISIBLE_DEVICES=%r devices %s",
            task_type,
            index,
            os.getpid(),
            gpu_visibility(),
            devices,
        )
        config = server_config(task)
        spec = tf.ClusterSpec(cluster)
        server = tf.Server(spec, job_name=task_type, task_index=index, protocol="grpc", config=config, start=True)
    log.info("%s:%d serving at %s", task_type, index, server.target)
    agent = agent_from_env(task_type, index, cluster[task_type][index], gpu_memory_fn(tf))
    if agent:
        try:
            agent.register(devices, deadline_s=task.register_timeout)
        except (Refused, TimeoutError) as e:
            leave(ConfigError(f"{task_type}:{index}: {e}"))

        def stop(reason: str, lost: bool) -> None:
            if lost:  # the chief is gone: leave, and say so with the exit code
                leave(PstrainError(f"{task_type}:{index}: {reason}; stopping"))
            log.info("%s:%d: %s", task_type, index, reason)
            os.kill(os.getpid(), signal.SIGTERM)

        agent.start(on_stop=stop)
    received = signal.sigwait({signal.SIGTERM, signal.SIGINT})
    log.info("%s:%d stopping on %s", task_type, index, signal.Signals(received).name)
    sys.stdout.flush()
    # A TF server cannot be stopped in-process; leaving now is the documented way down.
    os._exit(0)
