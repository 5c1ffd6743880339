"""The peers pstrain is measured against, one process role each (run by tests/benchmarks/bench.py).

    python -m tests.benchmarks.peers ROLE SIZE GLOBAL_BATCH STEPS

Roles: single (one process, no cluster), async (TF2 ParameterServerStrategy without a barrier:
the coordinator, with TF_CONFIG), tf1 (SyncReplicasOptimizer between-graph replication: ps or
worker, with TF_CONFIG), mwms (MultiWorkerMirroredStrategy worker, with TF_CONFIG), transfer (the
same bytes as a pstrain step moved over TF's gRPC, no compute: the coordinator), breakdown
(pstrain's engine with its closure cut short after each phase: the coordinator). The process that
measures prints one JSON line: {"step_s": mean seconds per global step over the run's second half, ...}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.benchmarks.jobs import HIDDEN, build_model, loss, optimizer, parameters  # noqa: E402

WARMUP = 3


FIRST_STEP_ENDED: list[float] = []


def timed(times: list[float], t0: float) -> None:
    """Record one step's duration, and the wall-clock time when the first step ended."""
    times.append(time.perf_counter() - t0)
    if len(times) == 1:
        FIRST_STEP_ENDED.append(time.time())


def report(times: list[float], **extra) -> None:
    first = FIRST_STEP_ENDED[0] if FIRST_STEP_ENDED else time.time()
    steady = times[max(WARMUP, len(times) // 2) :] or times  # the second half: TF1 runs its first ~100 steps faster
    result = {"step_s": sum(steady) / len(steady), "median_step_s": statistics.median(steady), "first_step_wall": first}
    print(json.dumps({**result, **extra}), flush=True)


def batch(size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((size, 784), dtype=np.float32), rng.integers(0, 10, size).astype(np.int32)


def single(size: str, global_batch: int, steps: int) -> None:
    model, opt = build_model(size), optimizer()
    x, y = batch(global_batch)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables, strict=True))

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(x, y)
        timed(times, t0)
    report(times)


def _coordinator():
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy), resolver.cluster_spec().num_tasks("worker")


def asynchronous(size: str, global_batch: int, steps: int) -> None:
    """TF's own PS training: each closure applies its worker's gradient at once (no barrier)."""
    strategy, coordinator, workers = _coordinator()
    with strategy.scope():
        model, opt = build_model(size), optimizer()
    per_worker = global_batch // workers
    x, y = batch(per_worker)

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables, strict=True))

        strategy.run(replica, args=(x, y))

    xt, yt = tf.constant(x), tf.constant(y)
    times = []
    for _ in range(steps):  # a "step" = one global batch = `workers` closures, as many updates
        t0 = time.perf_counter()
        for _ in range(workers):
            coordinator.schedule(step, args=(xt, yt))
        coordinator.join()
        timed(times, t0)
    report(times)


def transfer(size: str, global_batch: int, steps: int) -> None:
    """The bytes of one pstrain step without compute: each worker reads every parameter from the ps
    and writes as many values back, concurrently; the transfer limit for that model size."""
    strategy, coordinator, workers = _coordinator()
    with strategy.scope():
        model = build_model(size)
        sinks = [[tf.Variable(tf.zeros_like(v), trainable=False) for v in model.trainable_variables] for _ in range(workers)]

    def make(k):
        @tf.function
        def move():
            for v, sink in zip(model.trainable_variables, sinks[k], strict=True):
                sink.assign(v.read_value() + 1.0)  # pull, then push a same-size tensor back

        return move

    moves = [make(k) for k in range(workers)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for move in moves:
            coordinator.schedule(move)
        coordinator.join()
        timed(times, t0)
    report(times, bytes_per_step=2 * workers * 4 * parameters(size))


def tf1_sync_replicas(size: str, global_batch: int, steps: int) -> None:
    """The TF1 recipe: replica_device_setter + SyncReplicasOptimizer + MonitoredTrainingSession."""
    v1 = tf.compat.v1
    started = tf1_server()
    if started is None:
        return
    server, spec, index = started
    workers = spec.num_tasks("worker")
    x_np, y_np = batch(global_batch // workers, seed=index)
    with v1.device(v1.train.replica_device_setter(worker_device=f"/job:worker/task:{index}", cluster=spec)):
        x = v1.placeholder(tf.float32, x_np.shape)
        y = v1.placeholder(tf.int32, y_np.shape)
        h = HIDDEN[size]
        w1 = v1.get_variable("w1", [784, h])
        b1 = v1.get_variable("b1", [h], initializer=v1.zeros_initializer())
        w2 = v1.get_variable("w2", [h, h])
        b2 = v1.get_variable("b2", [h], initializer=v1.zeros_initializer())
        w3 = v1.get_variable("w3", [h, 10])
        b3 = v1.get_variable("b3", [10], initializer=v1.zeros_initializer())
        logits = tf.matmul(tf.nn.relu(tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2), w3) + b3
        value = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        global_step = v1.train.get_or_create_global_step()
        opt = v1.train.SyncReplicasOptimizer(
            v1.train.GradientDescentOptimizer(0.01), replicas_to_aggregate=workers, total_num_replicas=workers
        )
        train_op = opt.minimize(value, global_step=global_step)
    run_tf1_worker(server, index, opt, train_op, {x: x_np, y: y_np}, steps)


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


def run_tf1_worker(server, index: int, opt, train_op, feed: dict, steps: int) -> None:
    """Drive a TF1 SyncReplicasOptimizer worker for `steps` steps; worker 0 reports the step times."""
    v1 = tf.compat.v1
    hooks = [opt.make_session_run_hook(index == 0), v1.train.StopAtStepHook(last_step=steps + 1)]
    # A non-chief worker that finds the model uninitialised re-checks only every 30 s (TF1's
    # SessionManager default, not settable through MonitoredTrainingSession); poll every second.
    manager_init = v1.train.SessionManager.__init__

    def faster_polling(self, *args, recovery_wait_secs=1, **kwargs):
        manager_init(self, *args, recovery_wait_secs=recovery_wait_secs, **kwargs)

    v1.train.SessionManager.__init__ = faster_polling
    config = v1.ConfigProto(device_filters=["/job:ps", f"/job:worker/task:{index}"])
    times = []
    progress = os.environ.get("BENCH_PROGRESS_FILE") if index == 0 else None  # tests/benchmarks/cpu_split.py reads it
    with v1.train.MonitoredTrainingSession(
        master=server.target, is_chief=index == 0, hooks=hooks, config=config, stop_grace_period_secs=1
    ) as session:
        while not session.should_stop():
            t0 = time.perf_counter()
            session.run(train_op, feed_dict=feed)
            timed(times, t0)
            if progress and len(times) % 50 == 0:  # whole or not at all: the reader never sees a partial count
                Path(f"{progress}.tmp").write_text(str(len(times)))
                os.replace(f"{progress}.tmp", progress)
    if index == 0:
        report(times)


def mwms(size: str, global_batch: int, steps: int) -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = tf.distribute.cluster_resolver.TFConfigClusterResolver().task_id
    with strategy.scope():
        model, opt = build_model(size), optimizer()
    x_np, y_np = batch(global_batch // strategy.num_replicas_in_sync, seed=index)
    xt, yt = tf.constant(x_np), tf.constant(y_np)

    @tf.function
    def step():
        def replica():
            with tf.GradientTape() as tape:
                value = loss(yt, model(xt, training=True)) / strategy.num_replicas_in_sync
            opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables, strict=True))

        strategy.run(replica)

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        timed(times, t0)
    if index == 0:
        report(times)


ROLES = {
    "single": single,
    "async": asynchronous,
    "transfer": transfer,
    "tf1": tf1_sync_replicas,
    "mwms": mwms,
}

if __name__ == "__main__":
    role, size, global_batch, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ROLES[role](size, global_batch, steps)
    sys.stdout.flush()
    os._exit(0)  # coordinator threads would otherwise hold the exit
