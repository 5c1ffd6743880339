"""The rounds of one benchmark invocation, the same for every workload (bench.py, embeddings.py, recsys.py).

For one size: a warm-up round of every peer (run, printed, recorded, and left out of every figure:
cold imports and caches are paid there, by whichever peer runs first); then the K sweep: each tuned
peer (TUNED: TF2 async's steps per closure, MultiWorkerMirrored's steps per call) once with every K
of the sweep, the (peer, K) runs in a seeded shuffled order, the K of its fastest run used from then
on (a sweep of one K runs nothing: that K is used); then `repeats` measured rounds, each in its own
seeded shuffle of the peers. Every order, the sweep's figures and the K used are returned for the
JSON. A peer that fails (PeerFailed) is printed, recorded with why, and not run again. Figures across
the measured rounds: medians with their range. run_size records a size's rounds into the
invocation's JSON; print_size prints its lines.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

TUNED = ("async", "mwms")  # peers with a K of their own (tests/benchmarks/fair.py)
SWEEP = (4, 16, 64)  # the Ks tried by default; 16 was the dense 1 M async peer's best (issue 26)
WARMUP_ROUNDS = 1


class PeerFailed(RuntimeError):
    """A peer's processes ended without a result; the message is their last error lines."""


def add_round_args(parser: argparse.ArgumentParser) -> None:
    """--repeats, --warmup-rounds, --seed and --sweep, the same on every benchmark command."""
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds (medians and ranges over them)")
    parser.add_argument("--warmup-rounds", type=int, default=WARMUP_ROUNDS, help="rounds run first and discarded")
    parser.add_argument("--seed", type=int, default=0, help="seeds each round's shuffled peer order (recorded)")
    parser.add_argument(
        "--sweep",
        default=",".join(map(str, SWEEP)),
        help=f"Ks tried for {', '.join(TUNED)}, the fastest used; one K: used with no sweep runs; '' for 16",
    )


def sweep_values(text: str) -> tuple[int, ...]:
    """--sweep's Ks: positive integers, comma-separated ('' for none)."""
    values = tuple(int(k) for k in text.split(",") if k.strip())
    if any(k < 1 for k in values):
        raise ValueError(f"--sweep: every K must be a positive integer, got {text!r}")
    return values


def shuffled(items: list, seed: int, round_: int) -> list:
    """`items` in round `round_`'s order: a shuffle fixed by (seed, round)."""
    order = list(items)
    random.Random(f"{seed}:{round_}").shuffle(order)
    return order


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summary(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Each peer's step and start-up over the measured rounds: median, min and max."""
    return {
        peer: {"rounds": len(rs), "step_s": stats([r["step_s"] for r in rs]), "startup_s": stats([r["startup_s"] for r in rs])}
        for peer, rs in runs.items()
        if rs
    }


def run_rounds(
    run_one: Callable[[str, int | None], dict],
    peers: list[str],
    size: str,
    repeats: int,
    seed: int = 0,
    sweep: tuple[int, ...] = SWEEP,
    warmup_rounds: int = WARMUP_ROUNDS,
) -> dict:
    """`run_one(peer, k)` (k: None, or a tuned peer's K) through the warm-up, the sweep and the measured
    rounds. Returns {"runs": {peer: [measured results]}, "failed": {peer: why}, "seed", "orders": [each
    round's order, warm-up first], "warmup_rounds", "warmup": {peer: [step_s]}, "sweep": {peer: {K:
    step_s}}, "k": {peer: the K used}}."""
    failed: dict[str, str] = {}
    record: dict = {"seed": seed, "orders": [], "warmup_rounds": warmup_rounds, "warmup": {}, "sweep": {}, "k": {}}

    def attempt(peer: str, k: int | None, label: str) -> dict | None:
        if peer in failed:
            return None
        try:
            result = run_one(peer, k)
        except PeerFailed as e:
            failed[peer] = str(e)
            print(f"  {size} {label} {peer}: failed: {e}", flush=True)
            return None
        print(f"  {size} {label} {peer}{'' if k is None else f' K={k}'}: {result['step_s'] * 1000:.1f} ms/step", flush=True)
        return result

    for w in range(warmup_rounds):
        order = shuffled(peers, seed, -1 - w)
        record["orders"].append(order)
        for peer in order:
            if (r := attempt(peer, None, f"warm-up {w + 1} (discarded)")) is not None:
                record["warmup"].setdefault(peer, []).append(r["step_s"])
    tuned = [p for p in peers if p in TUNED]
    if len(sweep) == 1:  # one K: nothing to choose, so no sweep runs; the rounds run it
        record["k"] = {peer: sweep[0] for peer in tuned}
    else:
        for peer, k in shuffled([(p, k) for p in tuned for k in sweep], seed, 0):
            if (r := attempt(peer, k, "sweep")) is not None:
                record["sweep"].setdefault(peer, {})[k] = r["step_s"]
        record["k"] = {peer: min(ks, key=ks.get) for peer, ks in record["sweep"].items()}
    runs: dict[str, list[dict]] = {p: [] for p in peers}
    for repeat in range(repeats):
        order = shuffled(peers, seed, repeat + 1)
        record["orders"].append(order)
        for peer in order:
            if (r := attempt(peer, record["k"].get(peer), f"round {repeat + 1}")) is not None:
                runs[peer].append(r)
    return {"runs": runs, "failed": failed, **record}


def sweep_line(rounds: dict) -> str:
    """The sweep as printed: each tuned peer's ms/step at every K and the K it ran with."""
    parts = [
        f"{peer} " + ", ".join(f"K={k} {s * 1000:.1f}" for k, s in ks.items()) + f" ms -> K={rounds['k'][peer]}"
        for peer, ks in rounds["sweep"].items()
    ]
    orders = "; ".join(" ".join(order) for order in rounds["orders"])
    given = next(iter(rounds["k"].values()), 16)  # one K for every tuned peer when none was swept (16: fair.py)
    head = f"K swept: {'; '.join(parts)}" if parts else f"K not swept ({given} for the tuned peers)"
    return f"{head}\norders (seed {rounds['seed']}, {rounds['warmup_rounds']} warm-up round(s) first, discarded): {orders}"


def print_size(table_text: str, rounds: dict) -> None:
    """A size's lines: its table, the K sweep and the rounds' orders, how each peer ran."""
    for text in (table_text, sweep_line(rounds), setup_lines(rounds["runs"])):
        print(text, flush=True)


def setup_lines(runs: dict[str, list[dict]]) -> str:
    """How each peer ran (from its own report), so the output alone shows whether the race was fair."""
    return "how each peer ran:\n" + "\n".join(
        f"  {peer}: {rs[0]['setup']}" for peer, rs in runs.items() if rs and "setup" in rs[0]
    )


def record(results: dict, size: str, rounds: dict) -> None:
    """A size's rounds into the invocation's JSON: runs, failures, orders, sweep, K used, summary."""
    results["runs"][size] = rounds["runs"]
    results.setdefault("failed", {})[size] = rounds["failed"]
    results.setdefault("rounds", {})[size] = {k: v for k, v in rounds.items() if k not in ("runs", "failed")}
    results.setdefault("summary", {})[size] = summary(rounds["runs"])


def run_size(results: dict, size: str, peers: list[str], run_one: Callable[[str, int | None], dict], args) -> dict:
    """A size's rounds with the command's round arguments (add_round_args), recorded into `results`."""
    rounds = run_rounds(run_one, peers, size, args.repeats, args.seed, sweep_values(args.sweep), args.warmup_rounds)
    record(results, size, rounds)
    return rounds
