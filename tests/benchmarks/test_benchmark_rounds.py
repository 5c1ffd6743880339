"""The benchmark's rounds (tests/benchmarks/rounds.py) and every workload's data (tests/benchmarks/drawn.py):
a discarded warm-up round, seeded shuffled orders, the K sweep; fresh batches over whole tables,
pstrain's examples drawn alike on its workers. Runs no process: fake peers, and TF in the test."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import tensorflow as tf

from tests.benchmarks.drawn import EXAMPLES, SALT, check_fits
from tests.benchmarks.rounds import PeerFailed, run_rounds, shuffled, summary, sweep_line, sweep_values

pytestmark = pytest.mark.pure

PEERS = ["pstrain", "async", "mwms", "tf1", "single"]
BEST = {"async": 16, "mwms": 4}


def fake(calls: list):
    """A peer whose step is 10 ms, the tuned ones' 20 ms off their best K (and 10 at it)."""

    def run_one(peer: str, k: int | None) -> dict:
        calls.append((peer, k))
        if peer == "tf1" and calls.count(("tf1", None)) > 1:  # fails after the warm-up round
            raise PeerFailed("tf1 printed no result: UnavailableError: Socket closed")
        step = 0.010 if peer not in BEST or k in (None, BEST[peer]) else 0.020
        return {"step_s": step + 0.001 * len(calls), "startup_s": 4.0}

    return run_one


def test_a_warm_up_round_is_run_first_and_kept_out_of_every_figure():
    calls: list = []
    rounds = run_rounds(fake(calls), PEERS, "1m", repeats=3, seed=7, sweep=(4, 16), warmup_rounds=1)
    warm_up = calls[: len(PEERS)]
    assert sorted(peer for peer, _ in warm_up) == sorted(PEERS) and all(k is None for _, k in warm_up)
    assert set(rounds["warmup"]) == set(PEERS) and rounds["warmup_rounds"] == 1
    measured = {peer: [r["step_s"] for r in rs] for peer, rs in rounds["runs"].items()}
    warm = {peer: steps[0] for peer, steps in rounds["warmup"].items()}
    assert all(warm[peer] not in steps for peer, steps in measured.items())
    assert [len(measured[p]) for p in ("pstrain", "async", "mwms", "single")] == [3, 3, 3, 3]


def test_each_round_has_its_own_seeded_shuffle_recorded_and_the_same_seed_gives_the_same_orders():
    first = run_rounds(fake([]), PEERS, "1m", repeats=3, seed=7, sweep=(), warmup_rounds=1)
    again = run_rounds(fake([]), PEERS, "1m", repeats=3, seed=7, sweep=(), warmup_rounds=1)
    other = run_rounds(fake([]), PEERS, "1m", repeats=3, seed=8, sweep=(), warmup_rounds=1)
    assert len(first["orders"]) == 4 and all(sorted(o) == sorted(PEERS) for o in first["orders"])
    assert first["orders"] == again["orders"] and first["orders"] != other["orders"] and first["seed"] == 7
    assert len({tuple(o) for o in first["orders"]}) > 1  # not one fixed order
    assert first["orders"][1] == shuffled(PEERS, 7, 1)  # the order the JSON records is the order run


def test_each_tuned_peer_runs_every_k_of_the_sweep_and_the_rounds_use_its_fastest():
    calls: list = []
    rounds = run_rounds(fake(calls), PEERS, "10m", repeats=3, seed=0, sweep=(4, 16, 64), warmup_rounds=1)
    swept = calls[len(PEERS) : len(PEERS) + 6]
    assert sorted(swept) == sorted((p, k) for p in ("async", "mwms") for k in (4, 16, 64))
    assert {peer: sorted(ks) for peer, ks in rounds["sweep"].items()} == {"async": [4, 16, 64], "mwms": [4, 16, 64]}
    assert rounds["k"] == BEST
    measured = calls[len(PEERS) + 6 :]
    assert {k for peer, k in measured if peer == "async"} == {16} and {k for peer, k in measured if peer == "mwms"} == {4}
    assert {k for peer, k in measured if peer not in BEST} == {None}
    # tf1 failed in its first measured round: recorded with why, not run again; the others went on.
    assert rounds["failed"] == {"tf1": "tf1 printed no result: UnavailableError: Socket closed"}
    assert [peer for peer, _ in measured].count("tf1") == 1 and rounds["runs"]["tf1"] == []


def test_the_summary_is_each_peers_median_with_its_range():
    runs = {"pstrain": [{"step_s": s, "startup_s": 5.0 + s} for s in (0.3, 0.1, 0.2)], "tf1": []}
    assert summary(runs) == {
        "pstrain": {
            "rounds": 3,
            "step_s": {"median": 0.2, "min": 0.1, "max": 0.3},
            "startup_s": {"median": 5.2, "min": 5.1, "max": 5.3},
        }
    }
    assert sweep_values("4, 16,64") == (4, 16, 64) and sweep_values("") == ()
    with pytest.raises(ValueError, match="--sweep: every K must be a positive integer"):
        sweep_values("0,4")


# module, size, tables' (input name, rows) at that size
WORKLOADS = [
    ("tests.benchmarks.jobs", "1m", "tests.benchmarks.jobs:Mlp1M", []),
    ("tests.benchmarks.embeddings", "1k", "tests.benchmarks.embeddings:Emb1K", [(None, 1_000)]),
    ("tests.benchmarks.recsys", "tiny", "tests.benchmarks.recsys:RecTiny", [("user", 1_600), ("items", 400)]),
]


def ids_of(x, name):
    return (x if name is None else x[name]).numpy()


@pytest.mark.parametrize(("module", "size", "job", "tables"), WORKLOADS, ids=["dense", "embeddings", "recsys"])
def test_every_peer_draws_a_fresh_batch_each_step_over_whole_tables_and_pstrains_examples_are_drawn_alike(
    module, size, job, tables
):
    workload = importlib.import_module(module)
    seed = lambda a, b: tf.constant([a, b], tf.int64)  # noqa: E731
    x0, y0 = workload.fresh_batch(seed(0, 0), 512, size)
    x1, _ = workload.fresh_batch(seed(0, 1), 512, size)  # the next step's seed: another batch
    for a, b in zip(tf.nest.flatten(x0), tf.nest.flatten(x1), strict=True):
        assert not np.array_equal(a.numpy(), b.numpy())
    for name, rows in tables:  # ids over the whole table, not a part of it
        ids = ids_of(x0, name)
        assert ids.min() >= 0 and ids.max() < rows and ids.max() >= 0.9 * rows, (name, ids.max(), rows)
    # pstrain's job: a train_dataset() only (nothing made by the chief), EXAMPLES examples made by the
    # same draw from [SALT, i], read by position on the workers (no stateful random op in its map).
    from chief.contract.job import load_job
    from worker.input.datasets import draws_at_random

    loaded = load_job(job)
    assert loaded.train_dataset is not None and loaded.train_data is None and loaded.train_arrays is None
    dataset = loaded.train_dataset()
    assert int(dataset.cardinality()) == EXAMPLES and not draws_at_random(dataset)
    first, second = (tf.data.experimental.at(dataset, i) for i in (0, 1))
    assert not all(np.array_equal(a, b) for a, b in zip(tf.nest.flatten(first), tf.nest.flatten(second), strict=True))
    mine = workload.example(seed(SALT, 1), size)
    for a, b in zip(tf.nest.flatten(second), tf.nest.flatten(mine), strict=True):
        assert np.array_equal(a.numpy(), b.numpy())
    spec = tf.nest.map_structure(lambda t: (t.shape[1:], t.dtype), (x0, y0))
    assert tf.nest.map_structure(lambda t: (t.shape, t.dtype), (first[0], first[1])) == spec  # alike: one example of a batch


def test_a_run_longer_than_the_drawn_examples_is_refused_before_it_starts():
    assert check_fits(400, 256) == ""
    assert "an example would repeat" in check_fits(EXAMPLES // 128 + 1, 128)


def test_a_sweep_of_one_k_runs_no_sweep_and_the_rounds_use_that_k():
    calls: list = []
    rounds = run_rounds(fake(calls), PEERS, "1m", repeats=2, seed=0, sweep=(64,), warmup_rounds=0)
    assert rounds["sweep"] == {} and rounds["k"] == {"async": 64, "mwms": 64}
    assert len(calls) == 2 * len(PEERS)  # the measured rounds only
    assert {k for peer, k in calls if peer in ("async", "mwms")} == {64} and {k for peer, k in calls if peer not in BEST} == {
        None
    }
    assert sweep_line(rounds).startswith("K not swept (64 for the tuned peers)")
