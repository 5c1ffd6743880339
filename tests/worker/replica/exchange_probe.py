"""Run by tests/worker/replica/test_allreduce.py in a process of its own: `python -m
tests.worker.replica.exchange_probe [WORKERS]` (3 by default: the gather; 2: the all-reduce's sum).
The workers (in-process TF servers) exchange gradients whose sum depends on the order of addition
(for 3), with slots assigned against the workers' ranks (slot = (rank + 1) % WORKERS), as small
variables (for 2 also a large one: a collective of its own); prints, as JSON, what each closure got
and the references."""

from __future__ import annotations

import json
import socket
import sys

import numpy as np
import tensorflow as tf

from chief.step.rounding import same_rounding_everywhere
from worker.replica.allreduce import exchanged_mean
from worker.replica.gradients import mean_of_slots

SPLIT = 4091  # the first variable's size; the second has the other 5 of a slot's first 4,096 values
LARGE = 300_000  # 2 workers: two more variables of 1.2 MB each, each summed by a collective of its own


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(workers: int) -> None:
    same_rounding_everywhere()  # as every engine (chief/step/rounding.py)
    cluster = {"worker": [f"127.0.0.1:{free_port()}" for _ in range(workers)], "ps": [f"127.0.0.1:{free_port()}"]}
    spec = tf.train.ClusterSpec(cluster)
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=16)
    servers = [
        tf.distribute.Server(spec, job_name=j, task_index=i, config=config) for j in cluster for i in range(len(cluster[j]))
    ]
    strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc"))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    rng = np.random.default_rng(0)
    # 3: two large gradients that cancel and a small one: in float32 the sum rounds differently in another
    # order. 2: gradients of one size, most of whose float32 sums round (so a sum in another precision shows).
    scales = [(1e8, 100.0), (-1e8, 100.0), (0.0, 10.0)] if workers == 3 else [(0.0, 1.0)] * workers
    width = 4096 + (2 * LARGE if workers == 2 else 0)
    grads = [(big + spread * rng.normal(size=[width])).astype(np.float32) for big, spread in scales]
    table = tf.constant(np.stack(grads))

    def exchanging(small: bool):
        @tf.function(autograph=False)
        def closure():
            rank = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int32)
            slot = (rank + 1) % workers
            row = tf.gather(table, slot)  # as variables of unaligned sizes (split back from one sum), and large ones
            large = [tf.reshape(row[4096 + k * LARGE : 4096 + (k + 1) * LARGE], [-1, 100]) for k in range(2 * (workers == 2))]
            variables = [row[:SPLIT], tf.reshape(row[SPLIT:4096], [-1, 1]), *large] if small else large
            means = exchanged_mean(slot, variables, workers, group_key=1)
            flat = tf.concat([tf.reshape(m, [-1]) for m in means], 0)
            return tf.stack([tf.cast(rank, tf.float32), tf.cast(slot, tf.float32)]), flat

        return closure

    # 2 workers: the small and large variables, then the large alone (no packed collective), then both again
    runs = [True, False, True] if workers == 2 else [True]
    got, large_only = [], []
    for small in runs:
        closure = exchanging(small)
        results = [coordinator.schedule(closure) for _ in range(workers)]
        coordinator.join()
        (got if small else large_only).extend(r.fetch() for r in results)
    # The standalone engine's mean (traced, as its step is: a graph may round an add_n unlike an eager one).
    standalone = tf.function(lambda *slots: mean_of_slots([[g] for g in slots], workers)[0], autograph=False)
    in_slot_order = standalone(*grads).numpy()
    in_rank_order = standalone(*(grads[(r + 1) % workers] for r in range(workers))).numpy()
    print(
        json.dumps(
            {
                "ranks_slots": [g[0].tolist() for g in got],
                "equal_to_slot_order": [bool(np.array_equal(g[1], in_slot_order)) for g in got],
                "large_only_equal": [bool(np.array_equal(g[1], in_slot_order[4096:])) for g in large_only],
                "rank_order_differs": bool(not np.array_equal(in_rank_order, in_slot_order)),
                # values whose float32 sum is not the exact (float64) sum of the slots: rounded
                "sums_rounded": int(np.sum(sum(grads) != sum(g.astype(np.float64) for g in grads))),
            }
        )
    )
    del servers


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
