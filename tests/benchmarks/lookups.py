"""Lookup tables in the pipeline, as TF's ParameterServerStrategy tutorial puts them: the cluster against one process.

    python -m tests.benchmarks.lookups [--steps 200] [--repeats 3] [--out FILE]

For each guide job whose `train_dataset()` maps its examples through a Keras lookup layer (made in
`train_dataset()` as the tutorial's `dataset_fn` makes it, at the job module's top level, adapted once
in a cached function; tests/jobs/guides.py, guide_module_tables.py), `pstrain launch` (2 workers, 1 ps)
and `pstrain train --standalone` run in turn, `--repeats` times each, alternating, at global batch 32.
The step time is the wall time of the second half of the run's steps (metrics.jsonl), as the median
and range over the repeats; the ratio is the cluster's step over the one process's. Every pair ends
with the same loss at every step (asserted). docs/benchmarks/2026-12-06-lookup-tables-per-worker.md
records a run, before and after the tables got a copy per worker (worker/input/lookups.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

JOBS = {
    "in train_dataset() (the tutorial's dataset_fn, .batch(32).repeat())": "tests.jobs.guides:PssTutorialAsWritten",
    "at the job module's top level": "tests.jobs.guide_module_tables",
    "adapted once in a cached function": "tests.jobs.guides:PssHashingByPosition",
}
BATCH = 32


def step_ms(run_dir: Path) -> tuple[float, list[float]]:
    """(wall ms per step over the second half of the run's steps, every step's loss)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    half = steps[len(steps) // 2 :]
    return 1000 * (half[-1]["time"] - half[0]["time"]) / (len(half) - 1), [r["loss"] for r in steps]


def run(command: list[str], job: str, steps: int, run_dir: Path) -> tuple[float, list[float]]:
    args = [*command, "--job", job, "--steps", str(steps), "--global-batch-size", str(BATCH), "--checkpoint-every", "0"]
    done = subprocess.run([sys.executable, "-m", "cluster.cli", *args, "--run-dir", str(run_dir)], capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-2000:]
        raise SystemExit(f"lookups: error: pstrain {' '.join(args)} exited {done.returncode}; the end of its output:\n{tail}")
    return step_ms(run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.lookups", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="pstrain-lookups-") as scratch:
        for where, job in JOBS.items():
            cluster, alone = [], []
            for r in range(args.repeats):
                c, c_losses = run(["launch"], job, args.steps, Path(scratch) / f"{len(results)}-c{r}")
                s, s_losses = run(["train", "--standalone"], job, args.steps, Path(scratch) / f"{len(results)}-s{r}")
                if c_losses != s_losses:
                    raise SystemExit(f"lookups: {job}: the cluster's losses differ from the one process's")
                cluster.append(c)
                alone.append(s)
            results[where] = {"job": job, "cluster_ms": cluster, "standalone_ms": alone}
            ratio = statistics.median(cluster) / statistics.median(alone)
            print(
                f"tables {where}: cluster {statistics.median(cluster):.1f} ms/step ({min(cluster):.1f}-{max(cluster):.1f}), "
                f"{BATCH * 1000 / statistics.median(cluster):,.0f} examples/s; one process {statistics.median(alone):.1f} ms "
                f"({min(alone):.1f}-{max(alone):.1f}); cluster / one process {ratio:.2f}x",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps({"steps": args.steps, "batch": BATCH, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
