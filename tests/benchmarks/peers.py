"""The dense MLP's peers, one process role each (run by tests/benchmarks/bench.py).

    python -m tests.benchmarks.peers ROLE SIZE GLOBAL_BATCH STEPS

Roles here: tf1 (SyncReplicasOptimizer between-graph replication: ps or worker, with TF_CONFIG; no
tf_keras), transfer and transfer-looped (the bytes of a pstrain step moved over TF's gRPC, no
compute: the coordinator). The TF2 roles (single, async, async-1step, mwms) are
tests/benchmarks/fair.py's, on this MLP. The process that measures prints one JSON line:
{"samples": [[applied global steps, wall time], ...], "setup": how it ran, ...} (tests/benchmarks/window.py).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tests.benchmarks.command import role_process  # noqa: E402
from tests.benchmarks.fair import PER_DISPATCH, drive_moves, emit  # noqa: E402
from tests.benchmarks.jobs import CLASSES, HIDDEN, INPUTS, build_model, parameters  # noqa: E402


def _coordinator():
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy), resolver.cluster_spec().num_tasks("worker")


def transfer(size: str, global_batch: int, steps: int, k: int = 1) -> None:
    """The bytes of one pstrain step without compute: each worker reads every parameter from the ps
    and writes as many values back, concurrently; the transfer limit for that model size (k moves
    per closure: fair.drive_moves)."""
    strategy, coordinator, workers = _coordinator()
    with strategy.scope():
        model = build_model(size)
        sinks = [[tf.Variable(tf.zeros_like(v), trainable=False) for v in model.trainable_variables] for _ in range(workers)]

    def body(k):
        def move():
            for v, sink in zip(model.trainable_variables, sinks[k], strict=True):
                sink.assign(v.read_value() + 1.0)  # pull, then push a same-size tensor back

        return move

    samples, setup = drive_moves(coordinator, [body(i) for i in range(workers)], steps, k)
    emit(samples, setup, bytes_per_step=2 * workers * 4 * parameters(size))


def tf1_sync_replicas(size: str, global_batch: int, steps: int) -> None:
    """The TF1 recipe (tf1_role) on the MLP."""
    v1 = tf.compat.v1

    def loss(per: int):
        x = tf.random.normal([per, INPUTS])  # made on the worker, a fresh batch every run
        y = tf.random.uniform([per], 0, CLASSES, tf.int32)
        h = HIDDEN[size]
        w1 = v1.get_variable("w1", [784, h])
        b1 = v1.get_variable("b1", [h], initializer=v1.zeros_initializer())
        w2 = v1.get_variable("w2", [h, h])
        b2 = v1.get_variable("b2", [h], initializer=v1.zeros_initializer())
        w3 = v1.get_variable("w3", [h, 10])
        b3 = v1.get_variable("b3", [10], initializer=v1.zeros_initializer())
        logits = tf.matmul(tf.nn.relu(tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2), w3) + b3
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))

    tf1_role(global_batch, steps, 0.01, loss)


def tf1_role(global_batch: int, steps: int, learning_rate: float, loss: Callable[[int], tf.Tensor]) -> None:
    """The TF1 recipe, for every workload: replica_device_setter + SyncReplicasOptimizer (plain SGD at
    `learning_rate`, N = workers gradients per update) + MonitoredTrainingSession. `loss(per)` builds
    the worker's loss on a batch of per = global_batch // workers examples it makes itself; its
    variables go to the ps. A ps task serves until killed."""
    v1 = tf.compat.v1
    started = tf1_server()
    if started is None:
        return
    server, spec, index = started
    workers = spec.num_tasks("worker")
    with v1.device(v1.train.replica_device_setter(worker_device=f"/job:worker/task:{index}", cluster=spec)):
        value = loss(global_batch // workers)
        global_step = v1.train.get_or_create_global_step()
        opt = v1.train.SyncReplicasOptimizer(
            v1.train.GradientDescentOptimizer(learning_rate), replicas_to_aggregate=workers, total_num_replicas=workers
        )
        train_op = opt.minimize(value, global_step=global_step)
    run_tf1_worker(server, index, opt, train_op, steps)


def tf1_server():
    """Graph mode and this task's TF1 server from TF_CONFIG; a ps serves until killed (returns None),
    a worker gets (server, cluster spec, index)."""
    v1 = tf.compat.v1
    v1.disable_eager_execution()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec, job, index = resolver.cluster_spec(), resolver.task_type, resolver.task_id
    server = v1.train.Server(spec, job_name=job, task_index=index)
    if job == "ps":
        server.join()
        return None
    return server, spec, index


TF1_SETUP = "1 step per session.run, timed by the global step each run's sync token carries, data made on the workers (tf.random)"


def run_tf1_worker(server, index: int, opt, train_op, steps: int) -> None:
    """Drive a TF1 SyncReplicasOptimizer worker until global step `steps` + 1. Each run returns the sync
    token it dequeued: the global step after the apply that released it, so worker 0's samples are
    applied global steps, not its own run count. $BENCH_RUNS_DIR (tests): each worker's run count."""
    v1 = tf.compat.v1
    hooks = [opt.make_session_run_hook(index == 0), v1.train.StopAtStepHook(last_step=steps + 1)]
    # A non-chief worker that finds the model uninitialised re-checks only every 30 s (TF1's
    # SessionManager default, not settable through MonitoredTrainingSession); poll every second.
    manager_init = v1.train.SessionManager.__init__

    def faster_polling(self, *args, recovery_wait_secs=1, **kwargs):
        manager_init(self, *args, recovery_wait_secs=recovery_wait_secs, **kwargs)

    v1.train.SessionManager.__init__ = faster_polling
    config = v1.ConfigProto(device_filters=["/job:ps", f"/job:worker/task:{index}"])
    samples: list[list[float]] = []
    progress = os.environ.get("BENCH_PROGRESS_FILE") if index == 0 else None  # tests/benchmarks/cpu_split.py reads it
    runs_dir = os.environ.get("BENCH_RUNS_DIR")
    with v1.train.MonitoredTrainingSession(
        master=server.target, is_chief=index == 0, hooks=hooks, config=config, stop_grace_period_secs=1
    ) as session:
        while not session.should_stop():
            token = session.run(train_op)
            samples.append([int(token), time.time()])
            if progress and len(samples) % 50 == 0:  # whole or not at all: the reader never sees a partial count
                write_whole(progress, str(len(samples)))
            if runs_dir:
                write_whole(f"{runs_dir}/worker-{index}", str(len(samples)))
    if index == 0:
        emit(samples, TF1_SETUP, runs=len(samples), tf_keras_loaded="tf_keras" in sys.modules)


def write_whole(path: str, text: str) -> None:
    Path(f"{path}.tmp").write_text(text)
    os.replace(f"{path}.tmp", path)


ROLES = {
    "transfer": transfer,
    "transfer-looped": lambda size, batch, steps: transfer(size, batch, steps, PER_DISPATCH),
    "tf1": tf1_sync_replicas,
}

if __name__ == "__main__":
    role_process("tests.benchmarks.jobs", ROLES)
