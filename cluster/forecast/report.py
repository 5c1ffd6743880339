"""`pstrain plan`'s input parsing and its printed table: pure functions."""

from __future__ import annotations

import re
from collections.abc import Sequence

from cluster.errors import ConfigError
from cluster.forecast.model import Costs, HybridCosts, Piece, Prediction, Variable, choose_dense

UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8}
UNITS |= {"kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8, "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9}
RESOURCES = ("worker compute", "ps CPU", "ps network", "worker network", "worker compute + network", "chief", "shared cores")


def parse_bandwidth(text: str) -> float | None:
    """'10Gbit', '25 Gbit/s', '1.25GB/s' -> bytes per second; 'loopback' -> None (transfers are copies
    on one machine, already in the measured CPU)."""
    if text == "loopback":
        return None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)(/s)?\s*", text or "")
    unit = match.group(2).lower() + (match.group(3) or "") if match else ""
    unit = unit.removesuffix("/s") if unit.endswith("bit/s") else unit
    if not match or unit not in UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"--bandwidth: expected a rate like 10Gbit, 25Gbit/s or 1.25GB/s (or loopback), got {text!r}")
    return float(match.group(1)) * UNITS[unit]


def parse_counts(flag: str, text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; each a positive integer."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ConfigError(f"{flag}: expected positive whole numbers separated by commas (like 1,2,4), got {text!r}")
    return counts


def parse_cores(text: str) -> float | str | None:
    """'' -> None (a machine per task); 'here' -> 'here' (the most cores a measured run kept busy); '8' -> 8.0."""
    if text in ("", "here"):
        return text or None
    try:
        cores = float(text)
    except ValueError:
        cores = 0.0
    if cores <= 0:
        raise ConfigError(f"--cores: expected a number of cores above 0, or 'here', got {text!r}")
    return cores


def parse_runs(text: str, flag: str = "--measure", ps_counts: int = 2) -> list[tuple[int, int]]:
    """'1x1,2x1,1x2,2x2' -> [(workers, ps), ...]: the measured runs; at least two worker counts and
    `ps_counts` ps counts, so the fit can separate what grows with each."""
    runs = []
    example = "1x1,2x1,1x2,2x2" if ps_counts > 1 else "1x1,2x1"
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", part)
        if not match or min(int(match.group(1)), int(match.group(2))) < 1:
            raise ConfigError(f"{flag}: expected WORKERSxPS pairs like {example}, got {text!r}")
        runs.append((int(match.group(1)), int(match.group(2))))
    if len({w for w, _ in runs}) < 2 or len({p for _, p in runs}) < ps_counts:
        what = "two worker counts and two ps counts" if ps_counts > 1 else "two worker counts"
        raise ConfigError(f"{flag}: give at least {what} (like {example}), got {text!r}")
    return runs


def costs_lines(costs: Costs, batch: int, hybrid: HybridCosts | None = None) -> list[str]:
    ms = 1e3
    measured = []
    if hybrid:
        measured = [
            f'  with train.dense = "allreduce": worker {hybrid.base_s * ms:.2f} ms per step + its share of the batch'
            f" + {hybrid.ring_s * ms:.2f} ms per further worker (the exchange); ps {hybrid.ps_base_s * ms:.2f} ms per step"
            f" + {hybrid.ps_worker_s * ms:.2f} ms per worker"
        ]
    return [
        f"  worker: {costs.worker_base_s * ms:.2f} ms per step + {costs.worker_example_s * ms * batch:.2f} ms per global batch"
        f" ({costs.worker_example_s * 1e6:.1f} us per example) + {costs.worker_per_ps_s * ms:.2f} ms per ps",
        f"  ps: {costs.ps_base_s * ms:.2f} ms per step + {costs.ps_request_s * ms:.2f} ms per gradient per ps"
        f" + {costs.ps_gradient_s * ms:.2f} ms per gradient, split by bytes",
        f"  chief: {costs.chief_base_s * ms:.2f} ms per step + {costs.chief_per_worker_s * ms:.3f} ms per worker"
        f" + {costs.chief_sharded_s * ms:.2f} ms with 2 ps or more + {costs.chief_per_ps_s * ms:.2f} ms per ps beyond the first",
        *measured,
        f"  cores kept busy by the measured runs, at the most: {costs.cores:.2f}",
    ]


def bytes_line(variables: Sequence[Variable]) -> str:
    sparse = [v for v in variables if v.row_sparse]
    moved = sum(v.pull_bytes + v.push_bytes for v in variables)
    named = ", ".join(f"{short(v.name)} {v.push_bytes / 1024:.1f} KiB of {v.bytes / 2**20:.1f} MiB" for v in sparse) or "none"
    return f"bytes per worker per step: {moved / 2**20:.3f} MiB (pull and push), {len(variables)} variables; row-sparse: {named}"


def table(predictions: Sequence[tuple[int, int, Prediction]], modes: Sequence[str] | None = None) -> list[str]:
    """A markdown table, a row per prediction; `modes`: each row's train.dense, in a first column. A
    resource a row's mode does not have (worker network with "ps") shows as "-"."""
    shown = [r for r in RESOURCES if any(r in p.loads for _, _, p in predictions)]
    first = "| dense " if modes else ""
    head = f"{first}| workers | ps | step ms | examples/s | " + " | ".join(f"{r} ms" for r in shown) + " | binds |"
    lines = [head, "|---" * (5 + len(shown) + bool(modes)) + "|"]
    for i, (workers, ps, p) in enumerate(predictions):
        loads = " | ".join(f"{p.loads[r] * 1e3:.2f}" if r in p.loads else "-" for r in shown)
        mode = f"| {modes[i]} " if modes else ""
        lines.append(f"{mode}| {workers} | {ps} | {p.step_s * 1e3:.2f} | {p.examples_per_s:,.0f} | {loads} | {p.binding} |")
    return lines


def dense_line(workers: int, ps: int, by_ps: Prediction, allreduce: Prediction | None, refused: str) -> str:
    """The train.dense `choose_dense` picks for one scenario, and why: each mode's step and what binds it,
    or why "allreduce" is refused there."""
    chosen = choose_dense(by_ps, allreduce)
    ps_part = f'"ps" {by_ps.step_s * 1e3:.2f} ms, bound by {by_ps.binding}'
    if allreduce is None:
        return f'  {workers} workers, {ps} ps: train.dense = "ps" ({ps_part}); "allreduce" is refused there: {refused}'
    ar_part = f'"allreduce" {allreduce.step_s * 1e3:.2f} ms, bound by {allreduce.binding}'
    if chosen == "allreduce":
        return f'  {workers} workers, {ps} ps: train.dense = "allreduce" ({ar_part}; {ps_part})'
    return f'  {workers} workers, {ps} ps: train.dense = "ps" ({ps_part}; {ar_part}: not 5 % faster)'


def placement_lines(placement: Sequence[Piece], prediction: Prediction) -> list[str]:
    lines = []
    for ps in range(len(prediction.ps_cpu_s)):
        names = [short(p.name) + (f" (1/{round(1 / p.fraction)})" if p.fraction < 1 else "") for p in placement if p.ps == ps]
        lines.append(
            f"  ps:{ps}: CPU {prediction.ps_cpu_s[ps] * 1e3:.2f} ms, {prediction.ps_bytes[ps] / 2**20:.2f} MiB per step: "
            + (", ".join(names) or "nothing")
        )
    return lines


def short(name: str) -> str:
    return name.removesuffix(":0")
