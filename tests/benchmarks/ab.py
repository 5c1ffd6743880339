"""A change measured before and after: two checkouts of pstrain, the same job, runs interleaved.

    python -m tests.benchmarks.ab --before DIR --after DIR [--configs 1x2,2x2,4x2] [--rounds 3]
        [--job chief.jobs.digits] [--global-batch-size 64] [--steps 300] [--seed 0] [--out FILE]

Each round launches the job once per (workers x ps) configuration from each checkout, the two in a
seeded shuffled order per round and configuration, so a slow spell of a shared machine does not land on
one side only. A run is `pstrain plan`'s measurement (cluster/forecast/measure.py: the step over the
steps after the first third, and each role's CPU time per step; its start-up, launch to the first
applied step). Printed per configuration: each side's median step and start-up with their ranges, the
median CPU per step by role, and in how many rounds `--after` was the faster at each. Run it with
nothing else on the machine (`ps` first): on 2 shared cores one run can read a third slower than the
next.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from cluster.forecast.measure import measure
from tests.benchmarks.rounds import shuffled

SIDES = ("before", "after")


def configs(text: str) -> list[tuple[int, int]]:
    """ "1x2,4x2" -> [(1, 2), (4, 2)]: (workers, ps)."""
    try:
        pairs = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"--configs {text!r}: give WORKERSxPS pairs, e.g. 1x2,4x2")
    return pairs


def summarize(runs: list[dict]) -> dict:
    """Per configuration "WxP": each side's median step (ms) with its range, median CPU ms per step by
    role, and the rounds in which the after side was faster. `runs`: {"config", "round", "side",
    "step_ms", "cpu_ms": {role: ms}}, both sides of every (config, round)."""
    out: dict[str, dict] = {}
    for config in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == config]
        sides = {}
        for side in SIDES:
            steps = [r["step_ms"] for r in mine if r["side"] == side]
            roles = sorted({role for r in mine if r["side"] == side for role in r["cpu_ms"]})
            cpu = {role: statistics.median(r["cpu_ms"][role] for r in mine if r["side"] == side) for role in roles}
            starts = [r["startup_s"] for r in mine if r["side"] == side]
            sides[side] = {
                "median_ms": statistics.median(steps),
                "min_ms": min(steps),
                "max_ms": max(steps),
                "cpu_ms": cpu,
                "startup_s": statistics.median(starts),
                "startup_range_s": [min(starts), max(starts)],
            }
        rounds = sorted({r["round"] for r in mine})
        out[config] = {**sides, "rounds": len(rounds)}
        out[config].update(compared(mine, rounds, "step_ms", sides, "median_ms"))
        out[config].update(compared(mine, rounds, "startup_s", sides, "startup_s", prefix="startup_"))
    return out


def compared(runs: list[dict], rounds: list[int], key: str, sides: dict, median: str, prefix: str = "") -> dict:
    """In how many rounds the after side's `key` was the lower, and its median over the before side's."""
    by_round = {(r["round"], r["side"]): r[key] for r in runs}
    won = sum(by_round[n, "after"] < by_round[n, "before"] for n in rounds)
    ratio = sides["after"][median] / sides["before"][median]
    return {f"{prefix}after_faster_rounds": won, f"{prefix}after_over_before": ratio}


def line(config: str, s: dict) -> str:
    def side(name: str) -> str:
        d = s[name]
        cpu = ", ".join(f"{role} {ms:.2f}" for role, ms in d["cpu_ms"].items())
        lo, hi = d["startup_range_s"]
        start = f"launch to the first step {d['startup_s']:.2f} s ({lo:.2f}-{hi:.2f})"
        return f"{name} {d['median_ms']:.2f} ms ({d['min_ms']:.2f}-{d['max_ms']:.2f}; CPU ms per step: {cpu}); {start}"

    won = f"after faster in {s['after_faster_rounds']} of {s['rounds']} rounds"
    started = f"start-up after/before {s['startup_after_over_before']:.2f}, after faster in {s['startup_after_faster_rounds']}"
    started += f" of {s['rounds']}"
    head = f"{config}: step after/before {s['after_over_before']:.2f}, {won}; {started}"
    return f"{head}\n  {side('before')}\n  {side('after')}"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.ab", description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of pstrain (the change's parent)")
    parser.add_argument("--after", type=Path, required=True, help="a checkout of pstrain with the change")
    parser.add_argument("--configs", type=configs, default=configs("1x2,2x2,4x2"), help="WORKERSxPS, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job", default="chief.jobs.digits")
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write every run and the summary as JSON")
    args = parser.parse_args()
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    for side, path in checkouts.items():
        if not (path / "cluster" / "cli.py").is_file():
            parser.error(f"--{side} {path}: not a pstrain checkout (no cluster/cli.py)")
    runs = []
    for round_ in range(args.rounds):
        for workers, ps in args.configs:
            for side in shuffled(list(SIDES), args.seed, round_ * 1000 + workers * 10 + ps):
                # The launch and every task it starts import pstrain from this checkout.
                os.chdir(checkouts[side])
                os.environ["PYTHONPATH"] = str(checkouts[side])
                o = measure(args.job, workers, ps, args.global_batch_size, args.steps, args.steps // 3)
                cpu = {role: seconds * 1e3 for role, seconds in sorted(o.cpu_s.items())}
                assert o.startup_s is not None  # measure() always takes it
                config = f"{workers}x{ps}"
                step_ms, startup_s = o.step_s * 1e3, o.startup_s
                run = {"config": config, "round": round_, "side": side, "step_ms": step_ms, "cpu_ms": cpu, "startup_s": startup_s}
                runs.append(run)
                print(f"round {round_} {config} {side}: {step_ms:.2f} ms, start-up {startup_s:.2f} s", flush=True)
    result = summarize(runs)
    print("\n".join(line(config, s) for config, s in result.items()))
    if args.out:
        args.out.write_text(json.dumps({"args": sys.argv[1:], "runs": runs, "summary": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
