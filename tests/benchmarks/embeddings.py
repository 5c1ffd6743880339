"""Embedding tables: pstrain against its peers at two table sizes, same batch, same touched rows.

    python -m tests.benchmarks.embeddings [--sizes 1k,1m,10m] [--repeats 3] [--steps 400] [--scaling] [--sweep 4,16,64]
        [--link 1gbit]

The model: Embedding(ROWS, 64) over 12 tokens per example, mean-pooled, then Dense(64) and 10
logits; plain SGD. Token ids are drawn uniformly over the whole table by every peer, a fresh batch
every step, made where it is computed on (pstrain: tests/benchmarks/drawn.py, none repeated); a 1 M
and a 10 M table see as many rows touched per step (at most 128 x 12 = 1,536): what differs is only
the table. At 1k (1,000 rows: the chief's memory baseline) pstrain runs alone. Each size's lines
give the chief's peak resident memory beside the table's size, and a last line compares them over
the sizes (issue 31: 10 M within 300 MiB of 1k). Peers (a warm-up round, a sweep of the tuned peers'
K, then rounds in seeded shuffled orders: tests/benchmarks/rounds.py), each at its best and each on
a fresh batch every step: pstrain sync (2 workers, 1 ps; its default steps per dispatch, and one),
TF2 ParameterServerStrategy asynchronous tuned and one step per closure, the TF1
SyncReplicasOptimizer recipe (whose sparse accumulators keep embedding gradients sparse),
MultiWorkerMirroredStrategy, one process; and the transfer limit: closures that read the
touched rows from the ps and write as many back, no compute.
--scaling: pstrain and TF1 with 1, 2, 4 and 8 workers (1 M rows, global batch fixed, 1 ps).
--per-execution 1,4,16,64: pstrain alone with each number of steps per dispatch (1 M rows), interleaved.
--keras3: also the same job written with Keras 3 (`import keras`: the same layers, loss and SGD) as the
peer pstrain-keras3, beside the tf_keras job at every size (1k too).

Roles, as processes (run by this module's main): python -m tests.benchmarks.embeddings ROLE SIZE BATCH STEPS [K]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from functools import partial
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tests.benchmarks import links  # noqa: E402
from tests.benchmarks.command import main_or_role  # noqa: E402
from tests.benchmarks.drawn import DRAWN, check_fits, drawn, one_example  # noqa: E402
from tests.benchmarks.rounds import add_round_args, print_size, run_size  # noqa: E402

ROWS = {"1k": 1_000, "1m": 1_000_000, "5m": 5_000_000, "10m": 10_000_000}
PSTRAIN_ONLY = {"1k"}  # pstrain alone, for the chief's memory baseline
DIM, TOKENS, HIDDEN, CLASSES = 64, 12, 64, 10
PEERS = ("pstrain", "pstrain-k1", "async", "async-1step", "tf1", "mwms", "single")
KERAS3 = "pstrain-keras3"  # the Keras 3 twin of pstrain's job (--keras3)


def build_model(size: str):
    import tf_keras

    return tf_keras.Sequential(
        [
            tf_keras.layers.Input(shape=(TOKENS,), dtype="int32"),
            tf_keras.layers.Embedding(ROWS[size], DIM),
            tf_keras.layers.GlobalAveragePooling1D(),
            tf_keras.layers.Dense(HIDDEN, activation="relu"),
            tf_keras.layers.Dense(CLASSES),
        ]
    )


def build_keras3_model(size: str):
    """build_model's twin in Keras 3 (`import keras`): the same layers and shapes."""
    import keras

    return keras.Sequential(
        [
            keras.Input(shape=(TOKENS,), dtype="int32"),
            keras.layers.Embedding(ROWS[size], DIM),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )


def loss(y_true, y_pred):
    import tensorflow as tf
    import tf_keras

    return tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True))


def optimizer():
    import tf_keras

    return tf_keras.optimizers.legacy.SGD(learning_rate=0.05)


def fresh_batch(seed, n: int, size: str):
    """n examples from a [2] seed, made where it runs (tests/benchmarks/fair.py's peers): ids uniform
    over the whole table, labels uniform."""
    import tensorflow as tf

    sx, sy = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    ids = tf.random.stateless_uniform([n, TOKENS], sx, 0, ROWS[size], tf.int32)
    return ids, tf.random.stateless_uniform([n], sy, 0, CLASSES, tf.int32)


example = partial(one_example, fresh_batch)  # (seed, size): one example drawn as fresh_batch draws each of its n (pstrain's)


class _Job:
    size = ""
    loss_fn = staticmethod(loss)
    optimizer_fn = staticmethod(optimizer)

    @classmethod
    def model_fn(cls):
        return build_model(cls.size)

    bench_data = DRAWN

    @classmethod
    def train_dataset(cls):
        return drawn(fresh_batch, cls.size)


class Emb1K(_Job):
    size = "1k"


class Emb1M(_Job):
    size = "1m"


class Emb5M(_Job):
    size = "5m"


class Emb10M(_Job):
    size = "10m"


class _Keras3Job(_Job):
    """The same job in Keras 3: its model, its loss (mean sparse cross-entropy of logits), plain SGD."""

    @classmethod
    def model_fn(cls):
        return build_keras3_model(cls.size)

    @staticmethod
    def loss_fn():
        import keras

        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @staticmethod
    def optimizer_fn():
        import keras

        return keras.optimizers.SGD(learning_rate=0.05)


Emb1KKeras3, Emb1MKeras3, Emb5MKeras3, Emb10MKeras3 = (type(f"Emb{s.upper()}Keras3", (_Keras3Job,), {"size": s}) for s in ROWS)
JOBS = {size: f"tests.benchmarks.embeddings:Emb{size.upper()}" for size in ROWS}
JOBS_KERAS3 = {size: f"tests.benchmarks.embeddings:Emb{size.upper()}Keras3" for size in ROWS}


def dense_parameters() -> int:
    return DIM * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES


def touched_rows(batch: int, workers: int, rows: int, tokens: int = TOKENS) -> int:
    """Distinct rows one slot's batch of ids uniform over `rows` touches, averaged over 20 draws."""
    rng, per = np.random.default_rng(0), batch // workers
    return int(np.mean([len(np.unique(rng.integers(0, rows, per * tokens))) for _ in range(20)]))


# ---- peer roles (each runs in its own process) ----


def role_transfer(size: str, batch: int, steps: int, k: int = 1) -> None:
    """The touched rows (and the dense layers) read from the ps and as many values written back, per
    worker; k moves per closure (fair.drive_moves)."""
    import tensorflow as tf

    from tests.benchmarks.fair import drive_moves, emit
    from tests.benchmarks.peers import _coordinator

    strategy, coordinator, workers = _coordinator()
    rows = touched_rows(batch, workers, ROWS[size])
    with strategy.scope():
        model = build_model(size)
        table, dense = model.trainable_variables[0], model.trainable_variables[1:]
        sinks = [
            [
                tf.Variable(tf.zeros([rows, DIM]), trainable=False),
                *[tf.Variable(tf.zeros_like(v), trainable=False) for v in dense],
            ]
            for _ in range(workers)
        ]
    positions = tf.constant(np.arange(rows) * (ROWS[size] // rows), tf.int64)

    def body(i):
        def move():
            sinks[i][0].assign(tf.gather(table, positions) + 1.0)  # pull the rows, push as many values
            for v, sink in zip(dense, sinks[i][1:], strict=True):
                sink.assign(v.read_value() + 1.0)

        return move

    samples, setup = drive_moves(coordinator, [body(i) for i in range(workers)], steps, k)
    bytes_per_step = 2 * workers * 4 * (rows * DIM + dense_parameters())
    emit(samples, setup.replace("a step's bytes", "a step's touched rows"), bytes_per_step=bytes_per_step, rows_per_slot=rows)


def role_tf1(size: str, batch: int, steps: int) -> None:
    """TF1: replica_device_setter + SyncReplicasOptimizer (sparse accumulators for the table)."""
    import tensorflow as tf

    from tests.benchmarks.peers import tf1_role

    v1 = tf.compat.v1

    def loss(per: int):
        x = tf.random.uniform([per, TOKENS], 0, ROWS[size], tf.int32)  # made on the worker, a fresh batch every run
        y = tf.random.uniform([per], 0, CLASSES, tf.int32)
        table = v1.get_variable("table", [ROWS[size], DIM], initializer=v1.random_uniform_initializer(-0.05, 0.05))
        w1 = v1.get_variable("w1", [DIM, HIDDEN])
        b1 = v1.get_variable("b1", [HIDDEN], initializer=v1.zeros_initializer())
        w2 = v1.get_variable("w2", [HIDDEN, CLASSES])
        b2 = v1.get_variable("b2", [CLASSES], initializer=v1.zeros_initializer())
        pooled = tf.reduce_mean(tf.nn.embedding_lookup(table, x), axis=1)
        logits = tf.matmul(tf.nn.relu(tf.matmul(pooled, w1) + b1), w2) + b2
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))

    tf1_role(batch, steps, 0.05, loss)


ROLES = {
    "transfer": role_transfer,
    "transfer-looped": lambda size, batch, steps: role_transfer(size, batch, steps, 16),
    "tf1": role_tf1,
}  # and tests/benchmarks/fair.py's TF2 peers

# ---- orchestration (this process) ----


def run_peer(peer: str, size: str, batch: int, steps: int, workers: int = 2, device: str = "cpu", k: int | None = None) -> dict:
    from tests.benchmarks.bench import PSTRAIN_FLAGS, launch_peer, peer_pstrain

    if peer.startswith("pstrain"):
        extra = PSTRAIN_FLAGS.get(peer)
        job = (JOBS_KERAS3 if peer == KERAS3 else JOBS)[size]
        return peer_pstrain(size, batch, steps, workers=workers, job=job, extra=extra, device=device)
    return launch_peer("tests.benchmarks.embeddings", peer, size, batch, steps, workers, device, k)


def table(size: str, runs: dict[str, list[dict]], batch: int, failed: dict[str, str] | None = None) -> str:
    from tests.benchmarks.bench import limit_text, peer_rows, startup_line

    med = {peer: statistics.median(r["step_s"] for r in rs) for peer, rs in runs.items() if rs}
    base = med["pstrain"]
    title = f"\n{size}: Embedding({ROWS[size]:,} x {DIM}) + MLP, global batch {batch} x {TOKENS} tokens"
    lines = [title, *peer_rows(runs, batch, failed)]
    transfer = runs["transfer"][0]
    timing = {k: statistics.median(r["timing"][k] for r in runs["pstrain"]) for k in runs["pstrain"][0]["timing"]}
    lines.append(
        f"\npstrain step {base * 1000:.1f} ms (the chief's dispatch {timing['dispatch'] * 1000:.1f}, steps on workers and ps "
        f"{timing['steps'] * 1000:.1f}); {transfer['rows_per_slot']:,} rows touched per slot; bytes moved per step "
        f"{transfer['bytes_per_step'] / 2**20:.2f} MiB; {limit_text(runs, base)}; "
        f"pstrain chief peak RSS {max(r['chief_peak_rss_mib'] for r in runs['pstrain']):,} MiB "
        f"(table {ROWS[size] * DIM * 4 / 2**20:,.0f} MiB)"
    )
    lines.append(startup_line(runs["pstrain"]))
    return "\n".join(lines)


def table_mib(size: str) -> float:
    return ROWS[size] * DIM * 4 / 2**20


def chief_peak(runs: dict[str, list[dict]]) -> int:
    return max(r["chief_peak_rss_mib"] for r in runs["pstrain"])


def chief_line(size: str, runs: dict[str, list[dict]]) -> str:
    """A pstrain-only size: its step and the chief's peak beside the table's size."""
    step = statistics.median(r["step_s"] for r in runs["pstrain"])
    line = (
        f"\n{size}: Embedding({ROWS[size]:,} x {DIM}) + MLP (ids modulo {ROWS[size]:,}), pstrain alone: step "
        f"{step * 1000:.1f} ms; pstrain chief peak RSS {chief_peak(runs):,} MiB (table {table_mib(size):,.1f} MiB)"
    )
    if runs.get(KERAS3):  # --keras3: the twin beside it
        twin = statistics.median(r["step_s"] for r in runs[KERAS3])
        peak = max(r["chief_peak_rss_mib"] for r in runs[KERAS3])
        line += f"; the Keras 3 twin: step {twin * 1000:.1f} ms, chief peak RSS {peak:,} MiB"
    return line


def chief_memory_line(runs_by_size: dict[str, dict[str, list[dict]]]) -> str:
    """The chief's peak at each size beside the table's, and the largest size's growth over the smallest's."""
    peaks = {size: chief_peak(runs) for size, runs in runs_by_size.items() if runs.get("pstrain")}
    parts = [f"{size} {peak:,} MiB (table {table_mib(size):,.1f} MiB)" for size, peak in peaks.items()]
    line = "\nthe chief's peak resident memory by table: " + ", ".join(parts)
    if len(peaks) > 1:
        small, large = min(peaks, key=ROWS.get), max(peaks, key=ROWS.get)
        line += f"; {large} - {small}: {peaks[large] - peaks[small]:,} MiB (issue 31's bound: 300 MiB)"
    return line


SCALING = (1, 2, 4, 8)


def per_execution(values: list[int], batch: int, steps: int, repeats: int) -> dict[int, list[dict]]:
    """pstrain on 1 M rows with each steps_per_execution K, interleaved round by round."""
    from tests.benchmarks.bench import peer_pstrain

    runs: dict[int, list[dict]] = {k: [] for k in values}
    for repeat in range(repeats):
        for k in values:
            result = peer_pstrain("1m", batch, steps, job=JOBS["1m"], extra=["--steps-per-execution", str(k)])
            runs[k].append(result)
            print(f"  K round {repeat + 1} K={k}: {result['step_s'] * 1000:.1f} ms/step", flush=True)
    return runs


def per_execution_table(runs: dict[int, list[dict]], batch: int) -> str:
    lines = [
        f"\nsteps per dispatch: 1 M rows, 2 workers, 1 ps, global batch {batch}",
        "| K | ms/step | examples/s |",
        "|---|---|---|",
    ]
    for k, rs in runs.items():
        step = statistics.median(r["step_s"] for r in rs)
        lines.append(f"| {k} | {step * 1000:.1f} | {batch / step:,.0f} |")
    return "\n".join(lines)


def scaling(batch: int, steps: int, repeats: int, counts=SCALING) -> dict[str, dict[int, list[dict]]]:
    """pstrain and TF1 at each worker count (1 M rows, 1 ps, global batch fixed), interleaved."""
    runs: dict[str, dict[int, list[dict]]] = {"pstrain": {n: [] for n in counts}, "tf1": {n: [] for n in counts}}
    for repeat in range(repeats):
        for n in counts:
            for peer in runs:
                result = run_peer(peer, "1m", batch, steps, workers=n)
                runs[peer][n].append(result)
                print(f"  scaling round {repeat + 1} {peer} {n} workers: {result['step_s'] * 1000:.1f} ms/step", flush=True)
    return runs


def scaling_table(runs: dict[str, dict[int, list[dict]]], batch: int) -> str:
    step = {peer: {n: statistics.median(r["step_s"] for r in rs) for n, rs in by_n.items()} for peer, by_n in runs.items()}
    lines = [
        f"\nscaling: 1 M rows, 1 ps, global batch {batch}",
        "| workers | pstrain ms/step | TF1 ms/step | pstrain ÷ TF1 (examples/s) |",
        "|---|---|---|---|",
    ]
    for n in step["pstrain"]:
        mine, theirs = step["pstrain"][n], step["tf1"][n]
        lines.append(f"| {n} | {mine * 1000:.1f} | {theirs * 1000:.1f} | {theirs / mine:.2f}× |")
    low, high = min(step["pstrain"]), max(step["pstrain"])
    growth = {peer: step[peer][high] / step[peer][low] for peer in step}
    lines.append(f"step at {high} workers ÷ at {low}: pstrain {growth['pstrain']:.2f}×, TF1 {growth['tf1']:.2f}×")
    return "\n".join(lines)


def main() -> int:
    from tests.benchmarks.network import add_network_flag, apply_network_flag

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1k,1m,10m", help=f"of {', '.join(ROWS)}")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--scaling", action="store_true", help="also pstrain and TF1 at several worker counts (1m)")
    parser.add_argument("--scaling-workers", default="1,2,4,8", help="the worker counts of --scaling")
    parser.add_argument("--per-execution", default="", help="also pstrain with each K steps per dispatch, e.g. 1,4,16,64")
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="gpu: worker i on GPU i mod the GPUs here")
    parser.add_argument("--keras3", action="store_true", help="also the job in Keras 3 (peer pstrain-keras3), at every size")
    parser.add_argument("--out", default="")
    add_network_flag(parser)
    links.add_flags(parser)
    add_round_args(parser)
    args = parser.parse_args()
    if why := check_fits(args.steps, args.global_batch_size):
        parser.error(why)
    private_network = apply_network_flag(args)
    from tests.benchmarks.bench import METHOD, PROBES, new_results

    if why := links.use(args.link, args.plan_fit):  # refused in one line where namespaces cannot be made
        print(why, file=sys.stderr)
        return 2

    sizes, peers, batch = [s for s in args.sizes.split(",") if s], args.peers.split(","), args.global_batch_size
    twin = [KERAS3] if args.keras3 and KERAS3 not in peers else []  # once, however it was asked for
    results = new_results(batch, args.steps, private_network)
    print(f"# {results['machine']}; global batch {batch}; {args.steps} steps per run; {METHOD}", flush=True)
    for size in sizes:
        here = ["pstrain", *twin] if size in PSTRAIN_ONLY else [*peers, *twin, *PROBES]
        rounds = run_size(
            results, size, here, lambda peer, k, size=size: run_peer(peer, size, batch, args.steps, device=args.device, k=k), args
        )
        runs = rounds["runs"]
        print_size(chief_line(size, runs) if size in PSTRAIN_ONLY else table(size, runs, batch, rounds["failed"]), rounds)
    if sizes and ("pstrain" in peers or any(s in PSTRAIN_ONLY for s in sizes)):
        print(chief_memory_line(results["runs"]), flush=True)
    compared = [s for s in sizes if s not in PSTRAIN_ONLY]
    if len(compared) > 1 and "pstrain" in peers:
        steps = [statistics.median(r["step_s"] for r in results["runs"][s]["pstrain"]) for s in compared]
        print(f"\npstrain step at {compared[-1]} ÷ at {compared[0]}: {steps[-1] / steps[0]:.2f}×", flush=True)
    links.records(args, JOBS, results, batch)  # --link: the transfer limit and plan's step, per size
    if args.per_execution:
        values = [int(k) for k in args.per_execution.split(",")]
        results["per_execution"] = per_execution(values, batch, args.steps, args.repeats)
        print(per_execution_table(results["per_execution"], batch), flush=True)
    if args.scaling:
        counts = tuple(int(n) for n in args.scaling_workers.split(","))
        results["scaling"] = scaling(batch, args.steps, args.repeats, counts)
        print(scaling_table(results["scaling"], batch), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    main_or_role("tests.benchmarks.embeddings", ROLES, main)
