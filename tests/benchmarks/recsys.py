"""A recommender: two embedding tables and a dense tower, pstrain against its peers (issue 35).

    python -m tests.benchmarks.recsys [--sizes 1m,10m] [--repeats 3] [--steps 400] [--peers ...] [--out F]
        [--seed 0] [--sweep 4,16,64] [--warmup-rounds 1] [--link 1gbit] [--no-private-network]

The workload parameter servers exist for (TorchRec's, HugeCTR's and Monolith's shape): a user table
(80 % of the rows) looked up by one user id, an item table (20 %) looked up by HISTORY item ids
mean-pooled, and DENSE dense features, concatenated into a tower of TOWER ReLU layers of WIDTH units
and one click logit; binary cross-entropy, plain SGD. Sizes are the rows of both tables in all: 1m
(800,000 + 200,000) and 10m (8 M + 2 M), each with a tower of 2.2 M parameters; tiny (1,600 + 400
rows, a 64-wide tower) is for the tests. Every peer draws its ids uniformly over each whole table, a
fresh batch every step, made where it computes (pstrain: tests/benchmarks/drawn.py, none repeated).
Peers, rounds and timing as tests/benchmarks/embeddings.py's (rounds.py: a warm-up round, the K sweep,
shuffled rounds; medians with ranges); a peer that cannot start (MultiWorkerMirrored's broadcast of
a large table) is recorded in the JSON with why, and the others go on.

Roles, as processes (run by this module's main): python -m tests.benchmarks.recsys ROLE SIZE BATCH STEPS [K]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tests.benchmarks import links  # noqa: E402
from tests.benchmarks.command import main_or_role  # noqa: E402
from tests.benchmarks.drawn import DRAWN, check_fits, drawn, one_example  # noqa: E402
from tests.benchmarks.embeddings import touched_rows  # noqa: E402
from tests.benchmarks.network import add_network_flag, apply_network_flag  # noqa: E402
from tests.benchmarks.rounds import add_round_args, print_size, run_size  # noqa: E402

TABLES = {"tiny": (1_600, 400), "1m": (800_000, 200_000), "10m": (8_000_000, 2_000_000)}  # user rows, item rows
WIDTH = {"tiny": 64, "1m": 1024, "10m": 1024}
DIM, HISTORY, DENSE, TOWER = 64, 8, 13, 3
PEERS = ("pstrain", "pstrain-k1", "async", "async-1step", "tf1", "mwms", "single")


def tower_parameters(size: str) -> int:
    widths = [2 * DIM + DENSE] + [WIDTH[size]] * TOWER + [1]
    return sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))


def parameters(size: str) -> int:
    return sum(TABLES[size]) * DIM + tower_parameters(size)


def build_model(size: str):
    import tf_keras

    users, items = TABLES[size]
    inputs = {
        "user": tf_keras.Input((1,), dtype="int32", name="user"),
        "items": tf_keras.Input((HISTORY,), dtype="int32", name="items"),
        "features": tf_keras.Input((DENSE,), name="features"),
    }
    user = tf_keras.layers.Flatten()(tf_keras.layers.Embedding(users, DIM, name="user_table")(inputs["user"]))
    item = tf_keras.layers.GlobalAveragePooling1D()(tf_keras.layers.Embedding(items, DIM, name="item_table")(inputs["items"]))
    h = tf_keras.layers.Concatenate()([user, item, inputs["features"]])
    for _ in range(TOWER):
        h = tf_keras.layers.Dense(WIDTH[size], activation="relu")(h)
    return tf_keras.Model(inputs, tf_keras.layers.Dense(1)(h))


def loss(y_true, y_pred):
    import tensorflow as tf
    import tf_keras

    return tf.reduce_mean(tf_keras.losses.binary_crossentropy(y_true, y_pred, from_logits=True))


def optimizer():
    import tf_keras

    return tf_keras.optimizers.legacy.SGD(learning_rate=0.05)


def fresh_batch(seed, n: int, size: str):
    """n examples from a [2] seed, made where it runs (tests/benchmarks/fair.py's peers): ids uniform
    over each whole table, dense features normal, clicks 0 or 1."""
    import tensorflow as tf

    users, items = TABLES[size]
    s = tf.unstack(tf.random.experimental.stateless_split(seed, 4))
    x = {
        "user": tf.random.stateless_uniform([n, 1], s[0], 0, users, tf.int32),
        "items": tf.random.stateless_uniform([n, HISTORY], s[1], 0, items, tf.int32),
        "features": tf.random.stateless_normal([n, DENSE], s[2]),
    }
    return x, tf.cast(tf.random.stateless_uniform([n, 1], s[3], 0, 2, tf.int32), tf.float32)


example = partial(one_example, fresh_batch)  # (seed, size): one example drawn as fresh_batch draws each of its n (pstrain's)


class _Job:
    size = ""
    loss_fn = staticmethod(loss)
    optimizer_fn = staticmethod(optimizer)
    bench_data = DRAWN

    @classmethod
    def model_fn(cls):
        return build_model(cls.size)

    @classmethod
    def train_dataset(cls):
        return drawn(fresh_batch, cls.size)


class RecTiny(_Job):
    size = "tiny"


class Rec1M(_Job):
    size = "1m"


class Rec10M(_Job):
    size = "10m"


JOBS = {"tiny": "tests.benchmarks.recsys:RecTiny", "1m": "tests.benchmarks.recsys:Rec1M", "10m": "tests.benchmarks.recsys:Rec10M"}


# ---- peer roles (each runs in its own process) ----


def role_transfer(size: str, batch: int, steps: int, k: int = 1) -> None:
    """Each table's touched rows and the tower read from the ps and as many values written back, per
    worker, no compute; k moves per closure (fair.drive_moves)."""
    import tensorflow as tf

    from tests.benchmarks.fair import drive_moves, emit
    from tests.benchmarks.peers import _coordinator

    strategy, coordinator, workers = _coordinator()
    touched = [touched_rows(batch, workers, rows, tokens) for rows, tokens in zip(TABLES[size], (1, HISTORY), strict=True)]
    with strategy.scope():
        model = build_model(size)
        tables = [model.get_layer("user_table").embeddings, model.get_layer("item_table").embeddings]
        tower = [v for v in model.trainable_variables if all(v is not t for t in tables)]
        sinks = [[tf.Variable(tf.zeros([n, DIM]), trainable=False) for n in touched] for _ in range(workers)]
        tower_sinks = [[tf.Variable(tf.zeros_like(v), trainable=False) for v in tower] for _ in range(workers)]
    positions = [tf.constant(np.arange(n) * (rows // n), tf.int64) for n, rows in zip(touched, TABLES[size], strict=True)]

    def body(i):
        def move():
            for table, where, sink in zip(tables, positions, sinks[i], strict=True):
                sink.assign(tf.gather(table, where) + 1.0)  # pull the rows, push as many values
            for v, sink in zip(tower, tower_sinks[i], strict=True):
                sink.assign(v.read_value() + 1.0)

        return move

    samples, setup = drive_moves(coordinator, [body(i) for i in range(workers)], steps, k)
    bytes_per_step = 2 * workers * 4 * (sum(touched) * DIM + tower_parameters(size))
    emit(
        samples,
        setup.replace("a step's bytes", "a step's touched rows and tower"),
        bytes_per_step=bytes_per_step,
        rows_per_slot=sum(touched),
    )


def role_tf1(size: str, batch: int, steps: int) -> None:
    """TF1: replica_device_setter + SyncReplicasOptimizer (sparse accumulators for both tables)."""
    import tensorflow as tf

    from tests.benchmarks.peers import tf1_role

    v1 = tf.compat.v1
    users, items = TABLES[size]

    def loss(per: int):
        user = tf.random.uniform([per], 0, users, tf.int32)  # made on the worker, a fresh batch every run
        history = tf.random.uniform([per, HISTORY], 0, items, tf.int32)
        dense = tf.random.normal([per, DENSE])
        y = tf.cast(tf.random.uniform([per, 1], 0, 2, tf.int32), tf.float32)
        init = v1.random_uniform_initializer(-0.05, 0.05)
        user_table = v1.get_variable("user_table", [users, DIM], initializer=init)
        item_table = v1.get_variable("item_table", [items, DIM], initializer=init)
        pooled = tf.reduce_mean(tf.nn.embedding_lookup(item_table, history), axis=1)
        h = tf.concat([tf.nn.embedding_lookup(user_table, user), pooled, dense], axis=1)
        widths = [2 * DIM + DENSE] + [WIDTH[size]] * TOWER + [1]
        for n, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
            w = v1.get_variable(f"w{n}", [a, b])
            h = tf.matmul(h, w) + v1.get_variable(f"b{n}", [b], initializer=v1.zeros_initializer())
            h = tf.nn.relu(h) if n < TOWER else h
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=h))

    tf1_role(batch, steps, 0.05, loss)


ROLES = {
    "transfer": role_transfer,
    "transfer-looped": lambda size, batch, steps: role_transfer(size, batch, steps, 16),
    "tf1": role_tf1,
}  # and tests/benchmarks/fair.py's TF2 peers

# ---- orchestration (this process) ----


def run_peer(peer: str, size: str, batch: int, steps: int, device: str = "cpu", k: int | None = None) -> dict:
    from tests.benchmarks.bench import PSTRAIN_FLAGS, launch_peer, peer_pstrain

    if peer.startswith("pstrain"):
        job = JOBS[size]  # pstrain-allreduce too: the hybrid step takes legacy SGD (row-sparse table updates)
        return peer_pstrain(size, batch, steps, job=job, extra=PSTRAIN_FLAGS.get(peer), device=device)
    return launch_peer("tests.benchmarks.recsys", peer, size, batch, steps, device=device, k=k)


def table(size: str, runs: dict[str, list[dict]], batch: int, failed: dict[str, str]) -> str:
    from tests.benchmarks.bench import limit_text, med, peer_rows, startup_line

    users, items = TABLES[size]
    title = (
        f"\n{size}: tables {users:,} + {items:,} rows x {DIM}, a tower of {tower_parameters(size) / 1e6:.2f} M parameters, "
        f"global batch {batch}"
    )
    lines = [title, *peer_rows(runs, batch, failed)]
    if runs.get("pstrain") and runs.get("transfer"):
        transfer = runs["transfer"][0]
        lines.append(
            f"\n{transfer['rows_per_slot']:,} rows touched per slot; "
            f"bytes moved per step {transfer['bytes_per_step'] / 2**20:.2f} MiB; "
            f"{limit_text(runs, med(runs['pstrain'], 'step_s'))}"
        )
    if runs.get("pstrain"):
        lines.append(startup_line(runs["pstrain"]))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1m,10m", help=f"of {', '.join(TABLES)} (rows of both tables in all)")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="gpu: worker i on GPU i mod the GPUs here")
    parser.add_argument("--out", default="", help="write all results as JSON here")
    add_network_flag(parser)
    links.add_flags(parser)
    add_round_args(parser)
    args = parser.parse_args()
    sizes, peers, batch = [s for s in args.sizes.split(",") if s], args.peers.split(","), args.global_batch_size
    if unknown := [s for s in sizes if s not in TABLES]:
        parser.error(f"--sizes: unknown {', '.join(unknown)}; give any of {', '.join(TABLES)}")
    if why := check_fits(args.steps, batch):
        parser.error(why)
    if why := links.use(args.link, args.plan_fit):  # refused in one line where namespaces cannot be made
        print(why, file=sys.stderr)
        return 2
    private_network = apply_network_flag(args)
    from tests.benchmarks.bench import METHOD, PROBES, new_results

    results = new_results(batch, args.steps, private_network)
    results["workload"] = {
        size: {"tables": TABLES[size], "dim": DIM, "tower_parameters": tower_parameters(size)} for size in sizes
    }
    print(f"# {results['machine']}; global batch {batch}; {args.steps} steps per run; {METHOD}", flush=True)
    for size in sizes:
        rounds = run_size(
            results,
            size,
            [*peers, *PROBES],
            lambda peer, k, size=size: run_peer(peer, size, batch, args.steps, args.device, k),
            args,
        )
        print_size(table(size, rounds["runs"], batch, rounds["failed"]), rounds)
    links.records(args, JOBS, results, batch)  # --link: the transfer limit and plan's step, per size
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    main_or_role("tests.benchmarks.recsys", ROLES, main)
