"""`pstrain plan`: measure the user's job in short runs on this machine, fit the model
(cluster/forecast/model.py), print the predicted step for the workers, ps and bandwidth asked for."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from cluster.config import DEFAULT_JOB, TrainConfig, check_job_module
from cluster.errors import ConfigError
from cluster.forecast import report
from cluster.forecast.model import (
    Costs,
    HybridCosts,
    Observation,
    Scenario,
    allreduce_refusal,
    balanced_placement,
    fit,
    fit_allreduce,
    predict,
    predict_allreduce,
    propose_ps,
    pstrain_placement,
    refused_split,
)
from cluster.forecast.variables import JobBytes, job_bytes

DEFAULT_RUNS = "1x1,2x1,1x2,2x2,1x4"
DEFAULT_ALLREDUCE_RUNS = "1x1,2x1"


def add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="predict the step for N workers and P ps from short measured runs of the job")
    plan.add_argument("--job", default=DEFAULT_JOB, help="job module: package.module or package.module:attr")
    plan.add_argument("--global-batch-size", type=int, default=64, help="examples per step (as the run will use)")
    plan.add_argument("--workers", default="16", help="worker counts to predict, e.g. 16 or 8,16,32")
    plan.add_argument("--ps", default="1,2,4", help="ps counts to predict, e.g. 1,2,4")
    plan.add_argument(
        "--bandwidth", default="10Gbit", help="each machine's network, e.g. 10Gbit, 25Gbit/s, 1.25GB/s; loopback: one machine"
    )
    plan.add_argument("--rtt", type=float, default=0.1, help="network round trip in milliseconds (two per step)")
    plan.add_argument("--cores", default="", help="predict all tasks sharing N cores, or `here`: as the measured runs did")
    plan.add_argument("--measure", default=DEFAULT_RUNS, help="the measured runs here, WORKERSxPS (two worker and two ps counts)")
    plan.add_argument(
        "--measure-allreduce",
        default=DEFAULT_ALLREDUCE_RUNS,
        help='runs with train.dense = "allreduce", WORKERSxPS (two worker counts), where the launch takes it for the job; '
        '"": none, the hybrid worker\'s CPU then assumed',
    )
    plan.add_argument("--measure-steps", type=int, default=400, help="steps per measured run (measured after the first third)")
    plan.add_argument("--measure-repeats", type=int, default=1, help="make each measured run this many times, keep the fastest")
    plan.add_argument("--log", default="", help="append the measured runs' console output to this file")


def checked(args: argparse.Namespace) -> dict:
    """Every flag checked before anything starts; one line naming the flag on bad input."""
    if args.global_batch_size < 1:
        raise ConfigError(f"--global-batch-size: expected a positive whole number, got {args.global_batch_size}")
    if args.measure_steps < 200:
        raise ConfigError(f"--measure-steps: at least 200 steps, so a steady window follows the start, got {args.measure_steps}")
    if args.measure_repeats < 1:
        raise ConfigError(f"--measure-repeats: expected a positive whole number, got {args.measure_repeats}")
    if args.rtt < 0:
        raise ConfigError(f"--rtt: expected zero or more milliseconds, got {args.rtt}")
    runs = report.parse_runs(args.measure)
    hybrid_runs = report.parse_runs(args.measure_allreduce, "--measure-allreduce", ps_counts=1) if args.measure_allreduce else []
    for flag, pairs in (("--measure", runs), ("--measure-allreduce", hybrid_runs)):
        if uneven := sorted({w for w, _ in pairs if args.global_batch_size % w}):
            raise ConfigError(f"--global-batch-size: {args.global_batch_size} does not split over {uneven[0]} workers ({flag})")
    if split := [ps for _, ps in hybrid_runs if ps > 1]:
        raise ConfigError(f"--measure-allreduce: runs on 1 ps only (a dense variable split is refused), got {split[0]} ps")
    check_job_module(args.job)
    return {
        "workers": report.parse_counts("--workers", args.workers),
        "ps": report.parse_counts("--ps", args.ps),
        "bandwidth": report.parse_bandwidth(args.bandwidth),
        "runs": runs,
        "allreduce_runs": hybrid_runs,
        "cores": report.parse_cores(args.cores),
    }


def run_plan(args: argparse.Namespace) -> int:
    plan = checked(args)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM unwinds like Ctrl-C: each run is stopped and reaped
    # Ctrl-C even where SIGINT came in ignored (a background job of a script): Python then leaves it ignored.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    batch = args.global_batch_size
    try:
        found = job_bytes(args.job, batch // max(plan["workers"]))  # rows touched by the largest count's share
        variables = found.variables
        refuse_split(args.job, variables, [*plan["ps"], *(ps for _, ps in plan["runs"])])
        observations = measure_runs(args, plan["runs"])
        if plan["allreduce_runs"] and not found.allreduce_refused:
            observations += measure_runs(args, plan["allreduce_runs"], "allreduce")
    except KeyboardInterrupt:
        from cluster.errors import report as report_error

        return report_error("pstrain plan: interrupted; the measured run was stopped and reaped", 130)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    costs = fit(observations)
    hybrid = fit_allreduce(costs, observations) if any(o.dense == "allreduce" for o in observations) else None
    print("pstrain plan: fitted costs (CPU seconds per step, as measured on this machine)")
    print("\n".join(report.costs_lines(costs, batch, hybrid)))
    print(f"pstrain plan: {report.bytes_line(variables)}")
    print("pstrain plan: the measured runs against the model with their tasks sharing this machine's cores")
    for o in observations:
        shared = Scenario(o.workers, o.ps, o.batch, None, cores=costs.cores)
        placement = pstrain_placement(variables, o.ps)
        if o.dense == "allreduce":
            p = predict_allreduce(costs, variables, placement, shared, found.slots, TrainConfig().steps_per_execution, hybrid)
        else:
            p = predict(costs, variables, placement, shared)
        mode = ' (train.dense = "allreduce")' if o.dense == "allreduce" else ""
        print(f"  {o.workers} workers, {o.ps} ps{mode}: measured {o.step_s * 1e3:.2f} ms, model {p.step_s * 1e3:.2f} ms")
    cores = costs.cores if plan["cores"] == "here" else plan["cores"]
    where = f"every task sharing {cores:.2f} cores" if cores else "a machine per task"
    print(f"pstrain plan: predicted for global batch {batch}, {args.bandwidth} per machine, {args.rtt:g} ms round trip, {where}:")
    if found.allreduce_refused:
        print(f'pstrain plan: train.dense = "ps" only; the launch refuses "allreduce" for this job ({found.allreduce_refused})')
    elif hybrid is None:
        print('pstrain plan: "allreduce" predicted with its CPU assumed from the "ps" runs (no --measure-allreduce)')
    scenarios = [Scenario(w, ps, batch, plan["bandwidth"], args.rtt / 1e3, cores) for w in plan["workers"] for ps in plan["ps"]]
    rows, modes, lines = both_modes(costs, found, scenarios, TrainConfig().steps_per_execution, hybrid)
    print("\n".join(report.table(rows, modes)))
    if lines:
        print('pstrain plan: train.dense (the default is "ps"; "allreduce" where predicted at least 5 % faster):')
        print("\n".join(lines))
    for workers in plan["workers"]:
        scenario = Scenario(workers, 1, batch, plan["bandwidth"], args.rtt / 1e3, cores)
        count, best = propose_ps(costs, variables, scenario)
        chosen = Scenario(workers, count, batch, scenario.bandwidth, scenario.rtt_s, cores)
        placement = balanced_placement(variables, costs, chosen)
        print(
            f"pstrain plan: {workers} workers: use {count} ps: {best.step_s * 1e3:.2f} ms per step, "
            f"{best.examples_per_s:,.0f} examples/s, bound by {best.binding}; placement balanced by bytes and apply cost:"
        )
        print("\n".join(report.placement_lines(placement, best)))
    return 0


def both_modes(
    costs: Costs, found: JobBytes, scenarios: list[Scenario], block: int, hybrid: HybridCosts | None = None
) -> tuple[list, list[str], list[str]]:
    """Pure: the table's rows (workers, ps, prediction) and their train.dense, "ps" for every scenario and
    "allreduce" after it where taken, with K = `block` (the hybrid worker's costs `hybrid`, or assumed
    where None); and a line per scenario saying which mode to set,
    or why "allreduce" is refused on that ps count. No "allreduce" rows or lines where the launch refuses
    it for the job (`found.allreduce_refused`: its own one line)."""
    rows, modes, lines = [], [], []
    for scenario in scenarios:
        workers, ps = scenario.workers, scenario.ps
        by_ps = predict(costs, found.variables, pstrain_placement(found.variables, ps), scenario)
        rows.append((workers, ps, by_ps))
        modes.append("ps")
        if found.allreduce_refused:
            continue
        if why := allreduce_refusal(found.variables, ps):
            lines.append(report.dense_line(workers, ps, by_ps, None, why))
            continue
        placement = pstrain_placement(found.variables, ps)
        allreduce = predict_allreduce(costs, found.variables, placement, scenario, found.slots, block, hybrid)
        rows.append((workers, ps, allreduce))
        modes.append("allreduce")
        lines.append(report.dense_line(workers, ps, by_ps, allreduce, ""))
    return rows, modes, lines


def refuse_split(job: str, variables: list, ps_counts: list[int]) -> None:
    """ConfigError (one line, before any measured run) when the launch would refuse the job on one of
    `ps_counts`: a Keras 3 Lamb, Adafactor or Muon, or a constraint, on a variable split over ps."""
    refused = refused_split(variables, ps_counts)
    if refused:
        ps, why = refused
        raise ConfigError(
            f"pstrain plan: --job {job} is refused on {ps} ps or more ({why}); it trains on 1 ps only, "
            "and the plan needs two ps counts (--measure)"
        )


def measure_runs(args: argparse.Namespace, runs: list[tuple[int, int]], dense: str = "ps") -> list[Observation]:
    """Each of `runs` measured `args.measure_repeats` times, the fastest kept with its CPU: another
    process waking on shared cores only ever adds time, and CPU (its hand-offs), to a run."""
    from cluster.forecast.measure import measure

    observations = []
    mode = ' with train.dense = "allreduce"' if dense == "allreduce" else ""
    log = Path(args.log) if args.log else None
    for workers, ps in runs:
        what = f"{args.job} with {workers} workers and {ps} ps{mode}"
        tries = []
        for _ in range(args.measure_repeats):
            print(f"pstrain plan: measuring {what} ({args.measure_steps} steps)", flush=True)
            o = measure(args.job, workers, ps, args.global_batch_size, args.measure_steps, args.measure_steps // 3, log, dense)
            cpu = ", ".join(f"{role} {seconds * 1e3:.2f}" for role, seconds in sorted(o.cpu_s.items()))
            print(f"  {o.step_s * 1e3:.2f} ms per step; CPU ms per step: {cpu}; {o.cores_busy:.2f} cores busy", flush=True)
            tries.append(o)
        observations.append(min(tries, key=lambda o: o.step_s))
    return observations


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
