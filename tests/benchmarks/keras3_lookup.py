"""One Keras 3 `Embedding` lookup with its table on a ps: Keras's own call against pstrain's routed one.

    python -m tests.benchmarks.keras3_lookup [--repeats 20]

A ps and a worker server run inside this process on loopback; the table is built on the ps, and a
`tf.function` on the worker computes the lookup of 4 ids and its gradient. Keras's own `call`
(`ops.take`: the whole table read onto the worker, then a gather) against the one
chief/contract/keras3_lookup.py installs (a gather on the ps). Prints the median and fastest
milliseconds per lookup for each table size (docs/embeddings.md quotes them).
"""

from __future__ import annotations

import argparse
import os
import socket
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from chief.contract.keras3_lookup import route_lookups  # noqa: E402

SIZES = ((10_000, 16), (400_000, 64))
PS, WORKER = "/job:ps/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:0/device:CPU:0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def milliseconds(layer, call, repeats: int) -> list[float]:
    """Wall milliseconds of each of `repeats` lookups (after one to trace) of `call(layer, ids)` on the worker."""
    table, ids = layer._embeddings.value, tf.constant([[1, 5, 77, 9000]])

    @tf.function
    def step(ids):
        with tf.device(WORKER), tf.GradientTape() as tape:
            loss = tf.reduce_sum(call(layer, ids))
        return loss, tape.gradient(loss, table).values

    step(ids)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        [t.numpy() for t in step(ids)]
        times.append(1000 * (time.perf_counter() - start))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    spec = tf.train.ClusterSpec({"ps": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}"]})
    servers = [tf.distribute.Server(spec, job_name=job, task_index=0, start=True) for job in ("ps", "worker")]
    tf.config.experimental_connect_to_cluster(spec)
    route_lookups()
    routed = keras.layers.Embedding.call
    for rows, dim in SIZES:
        with tf.device(PS):
            layer = keras.layers.Embedding(rows, dim)
            layer.build()
        for name, call in (("Keras's own call", routed.__wrapped__), ("routed", routed)):
            times = milliseconds(layer, call, args.repeats)
            print(f"{rows} x {dim} {name}: median {np.median(times):.2f} ms, fastest {min(times):.2f} ms", flush=True)
    del servers


if __name__ == "__main__":
    main()
