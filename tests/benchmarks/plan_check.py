"""`pstrain plan`'s model against measured steps, for the record (docs/benchmarks/2026-12-04-plan-validation.md).

    python -m tests.benchmarks.plan_check [--job chief.jobs.digits] [--check 4x1,4x2] [--steps 300]

Measures the fitting runs (`--measure`, as `pstrain plan` does) and the `--check` runs on this machine,
fits the model on the fitting runs only, and prints each run's measured step against the model's, with
every task sharing the cores the fitting runs kept busy (`pstrain plan --cores here --bandwidth
loopback`). Then the plan for `--workers` at `--bandwidth`, a machine per task. Its CI check is
tests/cluster/forecast/test_plan_validation.py, which runs the same measurement, fit and prediction.
"""

from __future__ import annotations

import argparse
import os
import sys

from cluster.forecast.measure import measure
from cluster.forecast.model import Scenario, fit, predict, propose_ps, pstrain_placement
from cluster.forecast.report import costs_lines, parse_bandwidth, parse_runs, table
from cluster.forecast.variables import job_variables


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="chief.jobs.digits")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--measure", default="1x1,2x1,1x2,2x2,1x4")
    parser.add_argument("--check", default="4x1,4x2")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--bandwidth", default="10Gbit")
    args = parser.parse_args()
    fitting = parse_runs(args.measure)
    checks = [tuple(map(int, pair.split("x"))) for pair in args.check.split(",") if pair]
    runs = {(w, p): measure(args.job, w, p, args.batch, args.steps, args.steps // 3) for w, p in [*fitting, *checks]}
    costs = fit([runs[pair] for pair in fitting])
    variables = job_variables(args.job, args.batch // max(w for w, _ in runs))
    print(f"# {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {args.job}, batch {args.batch}, {args.steps} steps per run")
    print("\n".join(costs_lines(costs, args.batch)))
    print("\n| workers | ps | fitted on it | measured ms | model ms | error | chief / ps / worker CPU ms | cores busy |")
    print("|---|---|---|---|---|---|---|---|")
    for (w, p), o in runs.items():
        model = predict(costs, variables, pstrain_placement(variables, p), Scenario(w, p, args.batch, None, cores=costs.cores))
        cpu = " / ".join(f"{o.cpu_s.get(role, 0) * 1e3:.2f}" for role in ("chief", "ps", "worker"))
        fitted = "yes" if (w, p) in fitting else "no"
        error, step = model.step_s / o.step_s - 1, f"{o.step_s * 1e3:.2f} | {model.step_s * 1e3:.2f}"
        print(f"| {w} | {p} | {fitted} | {step} | {error:+.1%} | {cpu} | {o.cores_busy:.2f} |")
    bandwidth = parse_bandwidth(args.bandwidth)
    rows = [
        (
            args.workers,
            p,
            predict(costs, variables, pstrain_placement(variables, p), Scenario(args.workers, p, args.batch, bandwidth, 1e-4)),
        )
        for p in (1, 2, 4, 8)
    ]
    print(f"\n{args.workers} workers, {args.bandwidth}, a machine per task:")
    print("\n".join(table(rows)))
    count, best = propose_ps(costs, variables, Scenario(args.workers, 1, args.batch, bandwidth, 1e-4))
    print(f"proposed: {count} ps, {best.step_s * 1e3:.2f} ms, bound by {best.binding}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
