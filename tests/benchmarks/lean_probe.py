"""What the hybrid step costs without the ps on each step's path: a probe for the next lever (issue 35).

    python -m tests.benchmarks.lean_probe [--k 64] [--steps 640] [--ps-touches 0] [--data batch|drawn]
        [--size 1m|10m] [--exchange pstrain|gather|none]

The dense 1 M MLP (tests/benchmarks/jobs.py's layers, its fresh batches, legacy SGD's update) trained
as pstrain's hybrid step trains it: 2 workers, each with its own copy of every variable (pstrain's
`WorkerCopy`), each step's gradients and loss exchanged by pstrain's `exchanged_mean` (the slot-order
mean) and applied to the copies, `--k` steps per closure, a join per block. What it leaves out is
everything pstrain puts on a step's path through the ps: the step gate's waits, the loss's push and
the apply loop. `--ps-touches N` puts N round trips to the ps back on each step (an `assign_add` of a
ps variable the next step waits for) to price one. `--data batch` makes each slot's batch in one draw,
as the peers do; `--data drawn` reads it as pstrain reads the benchmark job's examples (its
`train_dataset()` of drawn examples, by position: tests/benchmarks/drawn.py,
worker/input/position_reads.py). `--size 10m` takes the 10 M MLP. `--exchange gather` takes the gather and
slot-order sum that 3+ workers use in place of the 2 workers' all-reduce, `none` each worker's own
gradients (no exchange: the copies then differ), to price the exchange. Not a product path: no
checkpoint, no fault handling; it checks that the two workers' copies ended equal. Prints one line:
`probe 1m K=.. touches=.. data=.. exchange=..: X ms/step (second half of the run), copies equal: True`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tests.benchmarks.drawn import drawn  # noqa: E402
from tests.benchmarks.jobs import CLASSES, HIDDEN, INPUTS, fresh_batch  # noqa: E402
from worker.input.position_reads import read_positions  # noqa: E402
from worker.replica.allreduce import WorkerCopy, exchanged_mean, gathered_mean  # noqa: E402

SERVER = (
    "import json, os, tensorflow as tf; c = json.loads(os.environ['TF_CONFIG']); "
    "tf.distribute.Server(c['cluster'], job_name=c['task']['type'], task_index=c['task']['index']).join()"
)
WORKERS, PER_SLOT, LEARNING_RATE, GROUP_KEY = 2, 128, 0.01, 7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(cluster: dict) -> list[subprocess.Popen]:
    """One process per worker and ps task, TF servers only (the caller kills and reaps them)."""
    procs = []
    for job in ("worker", "ps"):
        for index in range(len(cluster[job])):
            config = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
            procs.append(subprocess.Popen([sys.executable, "-c", SERVER], env={**os.environ, "TF_CONFIG": config}))
    return procs


def exchange(how: str, slot, values: list) -> list:
    """The step's mean of `values` among the workers: pstrain's `exchanged_mean` (2 workers: a ring
    all-reduce's sum), its gather form (`gathered_mean`, which 3+ workers take), or none (this
    worker's own)."""
    if how == "pstrain":
        return exchanged_mean(slot, values, WORKERS, GROUP_KEY)
    if how == "gather":
        return gathered_mean(slot, values, WORKERS, GROUP_KEY)
    return values


def probe(k: int, steps: int, touches: int, data: str, size: str = "1m", how: str = "pstrain") -> tuple[float, bool]:
    """(ms per step over the second half of `steps`, whether the workers' copies ended equal)."""
    cluster = {job: [f"127.0.0.1:{free_port()}" for _ in range(n)] for job, n in (("worker", WORKERS), ("ps", 1), ("chief", 1))}
    procs = start_servers(cluster)
    try:
        os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}})
        strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver())
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        h = HIDDEN[size]
        shapes = [[INPUTS, h], [h], [h, h], [h], [h, CLASSES], [CLASSES]]
        creator = lambda next_creator, **kwargs: WorkerCopy(strategy, next_creator, **kwargs)  # noqa: E731
        with tf.device("/job:worker/replica:0/task:0"), tf.variable_creator_scope(creator):
            copies = [tf.Variable(tf.random.stateless_normal(s, [i, 1]) * 0.05) for i, s in enumerate(shapes)]
        with strategy.scope():
            on_ps = tf.Variable(0, dtype=tf.int64)

        def logits(values, x):
            a = tf.nn.relu(x @ values[0] + values[1])
            a = tf.nn.relu(a @ values[2] + values[3])
            return a @ values[4] + values[5]

        @tf.function(autograph=False)
        def block(base, count, slot):
            def body(i, token):
                with tf.control_dependencies([token]):
                    values = [c.read_value() for c in copies]
                step = base[1] + tf.cast(i, tf.int64)
                if data == "batch":
                    x, y = fresh_batch(tf.stack([base[0], step]), PER_SLOT)
                else:  # slot s of step t: examples (t * WORKERS + s) * PER_SLOT onwards
                    first = (step * WORKERS + base[0]) * PER_SLOT
                    x, y = read_positions(drawn(fresh_batch), first + tf.range(PER_SLOT, dtype=tf.int64))
                with tf.GradientTape() as tape:
                    tape.watch(values)
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(values, x)))
                means = exchange(how, slot, [*tape.gradient(loss, values), loss[None]])
                done = [c.assign_sub(LEARNING_RATE * g) for c, g in zip(copies, means[:-1], strict=True)]
                for _ in range(touches):
                    with tf.control_dependencies(done):
                        done = [on_ps.assign_add(1)]
                with tf.control_dependencies(done):
                    return i + 1, tf.identity(means[-1][0])

            tf.while_loop(lambda i, _: i < count, body, (tf.constant(0), tf.constant(0.0)), parallel_iterations=1)
            return tf.stack([tf.reduce_sum(tf.cast(c.read_value(), tf.float64)) for c in copies])

        def run_block(count: int, done: int) -> list:
            args = lambda s: (tf.constant([s, done], tf.int64), tf.constant(count), tf.constant(s))  # noqa: E731
            results = [coordinator.schedule(block, args=args(s)) for s in range(WORKERS)]
            coordinator.join()
            return [r.fetch().tolist() for r in results]

        done, marks, sums = 0, [], []
        while done < steps:
            count = 1 if done == 0 else min(k, steps - done)  # the first step alone: tracing and start-up
            sums = run_block(count, done)
            done += count
            marks.append((done, time.monotonic()))
        half = [m for m in marks if m[0] >= steps // 2]
        return (half[-1][1] - half[0][1]) / (half[-1][0] - half[0][0]) * 1e3, all(s == sums[0] for s in sums)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.lean_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=64, help="steps per closure")
    parser.add_argument("--steps", type=int, default=640)
    parser.add_argument("--ps-touches", type=int, default=0, help="round trips to the ps put back on each step")
    parser.add_argument("--data", choices=("batch", "drawn"), default="batch", help="one draw per batch, or pstrain's read")
    parser.add_argument("--size", choices=("1m", "10m"), default="1m", help="the MLP's size")
    parser.add_argument("--exchange", choices=("pstrain", "gather", "none"), default="pstrain", help="how the workers average")
    args = parser.parse_args()
    ms, equal = probe(args.k, args.steps, args.ps_touches, args.data, args.size, args.exchange)
    what = f"probe {args.size} K={args.k} touches={args.ps_touches} data={args.data} exchange={args.exchange}"
    print(f"{what}: {ms:.1f} ms/step (second half of the run), copies equal: {equal}")


if __name__ == "__main__":
    main()
