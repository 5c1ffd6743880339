"""Where an in-graph step's time goes: the step loop alone, profiled by op type.

    python -m tests.benchmarks.loop_profile [--workers 2] [--blocks 8] [--per-execution 16]

A stripped copy of the cluster engine's block (chief/step/dispatch.py, worker/replica/loop.py,
worker/ps/apply.py): each worker's closure loops over K steps (wait at the step gate, the embedding
benchmark's model on a random batch, push to its slot's accumulators), while one function on the ps takes,
applies (plain SGD) and opens the next step. No data pipeline, no loss accumulator, no finite check: what is
left is the loop's own machinery. The servers (1 ps, the workers) run inside this process, so TF's profiler
sees every op; the steady blocks give ms/step and process CPU ms/step, then one profiled block gives each
op type's total time and count per step (`_Send` is a tensor or control edge crossing from one task to another).
"""

from __future__ import annotations

import argparse
import glob
import os
import socket
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tests.benchmarks.embeddings import build_model  # noqa: E402
from worker.ps.aggregator import SyncReplicasAggregator  # noqa: E402
from worker.ps.gate import ABORT, StepGate  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def op_table(logdir: str, steps: int) -> list[tuple[str, float, float]]:
    """(op type, ms per step, count per step) from the profile in `logdir`, most time first."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(glob.glob(f"{logdir}/plugins/profile/*/*.xplane.pb")[0], "rb") as f:
        space.ParseFromString(f.read())
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = names.get(event.metadata_id, "")
                if "/" in name and ":" in name:  # an op: "scope/name:Type"
                    kind = name.rsplit(":", 1)[1]
                    total[kind] += event.duration_ps / 1e9
                    count[kind] += 1
    return sorted(((k, total[k] / steps, count[k] / steps) for k in total), key=lambda row: -row[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--per-execution", type=int, default=16)
    parser.add_argument("--global-batch-size", type=int, default=128)
    args = parser.parse_args()
    n, k, batch = args.workers, args.per_execution, args.global_batch_size // args.workers
    cluster = {"worker": [f"127.0.0.1:{_port()}" for _ in range(n)], "ps": [f"127.0.0.1:{_port()}"]}
    spec = tf.train.ClusterSpec(cluster)
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=16)  # in-process servers share the process
    servers = [
        tf.distribute.Server(spec, job_name=j, task_index=i, config=config) for j in cluster for i in range(len(cluster[j]))
    ]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = build_model("1m")
        global_step = tf.Variable(tf.constant(0, tf.int64), trainable=False)
    variables = model.trainable_variables
    sparse = [i == 0 for i in range(len(variables))]  # the table
    aggregator = SyncReplicasAggregator(variables, required=n, total_slots=n, start_step=0, sparse=sparse)
    gate = StepGate(global_step.device)
    tf.function(gate.open)(tf.constant(0, tf.int64))

    @tf.function
    def worker_fn(first, count, slot: int):
        def body(i, token):
            step = first + tf.cast(i, tf.int64)
            token = gate.wait(step, global_step)

            def replica_fn(token):
                with tf.control_dependencies([token]):
                    seed = tf.stack([step, tf.constant(slot, tf.int64)])
                    ids = tf.random.stateless_uniform([batch, 12], seed, 0, 1_000_000, tf.int32)
                    labels = tf.random.stateless_uniform([batch], seed + 1, 0, 10, tf.int32)
                    with tf.GradientTape() as tape:
                        logits = model(ids)
                        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
                    grads = tape.gradient(loss, variables)
                grads = [
                    tf.IndexedSlices(g.values, tf.cast(g.indices, tf.int64), g.dense_shape) if s else g
                    for g, s in zip(grads, sparse, strict=True)
                ]
                with tf.control_dependencies(aggregator.push(slot, step, grads)):
                    return tf.equal(token, step)

            with tf.control_dependencies([strategy.run(replica_fn, args=(token,))]):
                return i + 1, token

        cond = lambda i, token: tf.logical_and(i < count, tf.not_equal(token, ABORT))  # noqa: E731
        tf.while_loop(cond, body, (tf.constant(0), tf.constant(0, tf.int64)), parallel_iterations=1)
        return tf.constant(True)

    @tf.function
    def apply_fn(first, count):
        def body(i):
            step = first + tf.cast(i, tf.int64)
            means = aggregator.take_mean(step, tf.constant([True] * n))
            updates = [
                v.scatter_sub(tf.IndexedSlices(m.values * 0.01, m.indices))
                if isinstance(m, tf.IndexedSlices)
                else v.assign_sub(m * 0.01)
                for v, m in zip(variables, means, strict=True)
            ]
            with tf.control_dependencies(updates):
                moved = global_step.assign(step + 1)
            with tf.control_dependencies([moved]):
                opened = gate.advance(step)
            with tf.control_dependencies([opened]):
                return i + 1

        return tf.while_loop(lambda i: i < count, body, (tf.constant(0),), parallel_iterations=1)

    def block(first: int) -> None:
        for slot in range(n):
            coordinator.schedule(worker_fn, args=(tf.constant(first, tf.int64), tf.constant(k), slot))
        with tf.device(global_step.device):
            apply_fn(tf.constant(first, tf.int64), tf.constant(k))
        coordinator.join()

    walls, cpus = [], []
    for b in range(args.blocks):
        wall, cpu = time.perf_counter(), time.process_time()
        block(b * k)
        walls.append((time.perf_counter() - wall) * 1000 / k)
        cpus.append((time.process_time() - cpu) * 1000 / k)
    steady = sorted(walls[2:])
    print(
        f"{n} workers, K={k}: {steady[len(steady) // 2]:.2f} ms/step (median of {len(steady)} blocks), "
        f"process CPU {sorted(cpus[2:])[len(steady) // 2]:.2f} ms/step"
    )
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        block(args.blocks * k)
        tf.profiler.experimental.stop()
        rows = op_table(logdir, k)
    print(f"one profiled block, per step: ops {sum(r[1] for r in rows):.2f} ms in {sum(r[2] for r in rows):.0f} ops")
    print("| op type | ms/step | count/step |\n|---|---|---|")
    for kind, ms, count in rows[:12]:
        print(f"| {kind} | {ms:.2f} | {count:.1f} |")
    del servers
    os._exit(0)  # in-process servers cannot be stopped


if __name__ == "__main__":
    raise SystemExit(main())
