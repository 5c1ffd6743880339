"""The step at scale, as pure arithmetic: measured costs in, step time and the binding resource out.

A synchronous step has four resources that each must do their share of it:
- **worker compute**: one worker's CPU per step, `worker_base_s + worker_example_s * B / N +
  worker_per_ps_s * P` (its fixed work, its share of the global batch, its requests to each ps);
- **ps CPU**: the busiest ps, `ps_base_s + N * ps_request_s + N * ps_gradient_s * share` (its fixed
  work, one request per gradient, and accumulating and applying its share of each gradient's bytes);
- **ps network**: the busiest ps's bytes, N workers' pulls and pushes of what it holds, over the
  bandwidth, plus two round trips per step; or one worker's bytes, if more;
- **the chief**: its CPU per step, `chief_base_s + chief_per_worker_s * N + chief_sharded_s * [P > 1] +
  chief_per_ps_s * (P - 1)` (a step up from one ps to two: about 4 ms while the apply loop ran on the
  chief with several ps, until 2026-12-07; about 0.2 ms since, at 4 workers: 1.22 ms on 2 ps, 1.03 on 1).
The predicted step is the largest of them (the one that binds), a roofline: the others overlap with it.
On a link, the worker's compute and the ps's network are one bound, `worker compute + network`: a
synchronous step's pulls land before its forward pass, its pushes leave after its backward pass, and
the next step's pulls wait for the apply, so they are counted in series (an upper bound where TF
overlaps a layer's transfer with another's compute: docs/plan.md).
Where every task shares `cores` cores (one machine, as in the
measured run), all tasks' CPU over the cores is a further bound, `shared cores`. That is train.dense =
"ps" (`predict`); train.dense = "allreduce", the hybrid step, is `predict_allreduce`: its worker's CPU
fitted on hybrid runs (`fit_allreduce`), its exchange on the workers' links, in series with their
compute likewise.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_SHARD_BYTES = 256 << 10  # as chief/state/sharding.py: variables at least this large split over the ps


@dataclass(frozen=True)
class Variable:
    """A trainable variable: its full size, and the bytes one worker pulls and pushes per step
    (all of it when dense; the touched rows when its gradient is row-sparse, a Keras 3 table's too:
    chief/variable_bytes.py). Keras 3 and tf_keras variables split over the ps alike."""

    name: str
    bytes: int
    rows: int
    pull_bytes: float
    push_bytes: float
    split_refused: str = ""  # why the launch refuses it split over ps (a Keras 3 Lamb's table); "" where it trains split
    row_sparse: bool = False  # its gradient is row slices (a table): it stays on the ps with train.dense = "allreduce"


@dataclass(frozen=True)
class Observation:
    """One measured run: wall seconds per step and CPU seconds per step by role (each role summed
    over its tasks: `chief`, `ps`, `worker`), with the run's train.dense and its start-up."""

    workers: int
    ps: int
    batch: int
    step_s: float
    cpu_s: dict[str, float]
    dense: str = "ps"
    startup_s: float | None = None  # launch to the first applied step, where the run measured it

    @property
    def cores_busy(self) -> float:
        return sum(self.cpu_s.values()) / self.step_s


@dataclass(frozen=True)
class Costs:
    """The fitted inputs of the model, seconds per step (see the module's docstring)."""

    worker_base_s: float
    worker_example_s: float
    worker_per_ps_s: float
    ps_base_s: float
    ps_request_s: float
    ps_gradient_s: float
    chief_base_s: float
    chief_per_worker_s: float
    chief_sharded_s: float  # once there are two ps or more
    chief_per_ps_s: float  # per ps beyond the first
    cores: float  # the most cores a measured run's tasks kept busy together


@dataclass(frozen=True)
class HybridCosts:
    """The costs of a step with train.dense = "allreduce", fitted on its own runs (`fit_allreduce`), in
    seconds per step: one worker's CPU beyond its share of the batch, `base_s` (what it does once a step
    whatever the worker count, its copies' update included) and `ring_s` per further worker (one ring
    step of the exchange: the gradient it receives, sends on and adds); and the ps's CPU, `ps_base_s`
    (its fixed work: the step gate, the stop request's read, the write-back) and `ps_worker_s` per
    worker (that worker's loss and table rows: pulled, pushed, applied)."""

    base_s: float
    ring_s: float
    ps_base_s: float = 0.0
    ps_worker_s: float = 0.0


@dataclass(frozen=True)
class Scenario:
    workers: int
    ps: int
    batch: int
    bandwidth: float | None  # bytes/s of each task's network; None: transfers cost only CPU (loopback)
    rtt_s: float = 0.0
    cores: float | None = None  # all tasks share these cores (one machine); None: a machine per task


@dataclass(frozen=True)
class Piece:
    """A variable, or one shard of it, on one ps."""

    name: str
    fraction: float  # of the variable's rows
    ps: int


@dataclass(frozen=True)
class Prediction:
    step_s: float
    examples_per_s: float
    binding: str
    loads: dict[str, float]  # seconds per step per resource
    ps_cpu_s: tuple[float, ...]  # per ps
    ps_bytes: tuple[float, ...]  # per ps, bytes per step (all workers, both ways)


def nonnegative_fit(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best fit over the subsets of columns whose
    unconstrained solution is non-negative (a handful of columns, so every subset is tried)."""
    n = features.shape[1]
    best, best_error = np.zeros(n), float(np.sum(target**2))
    for size in range(1, n + 1):
        for cols in itertools.combinations(range(n), size):
            coef, *_ = np.linalg.lstsq(features[:, cols], target, rcond=None)
            if np.all(coef >= 0):
                error = float(np.sum((features[:, cols] @ coef - target) ** 2))
                if error < best_error - 1e-18:
                    full = np.zeros(n)
                    full[list(cols)] = coef
                    best, best_error = full, error
    return best


def fit(observations: Sequence[Observation]) -> Costs:
    """The costs that best explain the runs with train.dense = "ps" (non-negative least squares per
    role; runs of the other mode are left to `fit_allreduce`). Needs such runs with
    two worker counts and two ps counts; raises ValueError otherwise. With only one and two ps, the
    chief's step to two ps and its cost per further ps cannot be told apart: the fit takes the step
    (the first of equal fits), so a third ps count (`1x4`) is what measures the slope."""
    observations = [o for o in observations if o.dense == "ps"]
    if len({o.workers for o in observations}) < 2 or len({o.ps for o in observations}) < 2:
        raise ValueError("fit: give runs with at least two worker counts and two ps counts")
    n = np.array([o.workers for o in observations], dtype=float)
    p = np.array([o.ps for o in observations], dtype=float)
    b = np.array([o.batch for o in observations], dtype=float)
    ones = np.ones_like(n)
    worker = nonnegative_fit(np.stack([n, b, n * p], 1), np.array([o.cpu_s.get("worker", 0.0) for o in observations]))
    ps = nonnegative_fit(np.stack([p, n * p, n], 1), np.array([o.cpu_s.get("ps", 0.0) for o in observations]))
    chief = nonnegative_fit(
        np.stack([ones, n, (p > 1).astype(float), p - 1], 1), np.array([o.cpu_s.get("chief", 0.0) for o in observations])
    )
    # the most cores any run kept busy: runs with more tasks keep more busy (fewer waits for one task), and
    # a scenario predicted is usually larger than the runs measured; their mean over-predicted 4 workers
    cores = float(max(o.cores_busy for o in observations))
    return Costs(*map(float, (*worker, *ps, *chief)), cores=cores)


def fit_allreduce(costs: Costs, observations: Sequence[Observation]) -> HybridCosts:
    """The hybrid step's costs (`HybridCosts`) that best explain the runs with train.dense = "allreduce"
    (non-negative least squares: on each worker's CPU per step less its share of the batch,
    `costs.worker_example_s`, and its requests to each ps beyond the first; on the ps's CPU per step
    over the ps, by worker count). Needs such runs with two worker counts (1 and 2 workers: no
    exchange, then one ring step); raises ValueError otherwise."""
    runs = [o for o in observations if o.dense == "allreduce"]
    if len({o.workers for o in runs}) < 2:
        raise ValueError('fit_allreduce: give runs with train.dense = "allreduce" and at least two worker counts')
    n = np.array([o.workers for o in runs], dtype=float)
    p = np.array([o.ps for o in runs], dtype=float)
    b = np.array([o.batch for o in runs], dtype=float)
    cpu = np.array([o.cpu_s.get("worker", 0.0) for o in runs]) / n  # one worker's
    own = cpu - costs.worker_example_s * b / n - costs.worker_per_ps_s * (p - 1)
    base, ring = nonnegative_fit(np.stack([np.ones_like(n), n - 1], 1), own)
    ps = np.array([o.cpu_s.get("ps", 0.0) for o in runs]) / p  # one ps's
    ps_base, ps_worker = nonnegative_fit(np.stack([np.ones_like(n), n / p], 1), ps)
    return HybridCosts(float(base), float(ring), float(ps_base), float(ps_worker))


def shards(variable: Variable, num_ps: int) -> int:
    """How many shards pstrain splits a variable into over `num_ps` ps (MinSizePartitioner's rule)."""
    if num_ps < 2:
        return 1
    return max(1, min(num_ps, variable.rows, variable.bytes // MIN_SHARD_BYTES))


def refused_split(variables: Sequence[Variable], ps_counts: Sequence[int]) -> tuple[int, str] | None:
    """(the fewest ps among `ps_counts` on which the launch refuses the job, why) where a variable it
    would split there cannot train split (`Variable.split_refused`); None where every count trains."""
    for ps in sorted(set(ps_counts)):
        for v in variables:
            if v.split_refused and shards(v, ps) > 1:
                return ps, v.split_refused
    return None


def pstrain_placement(variables: Sequence[Variable], num_ps: int) -> list[Piece]:
    """Where pstrain puts the variables today: large ones split in equal shards, every piece on the
    next ps in turn (the strategy's round robin, in creation order)."""
    pieces, turn = [], 0
    for v in variables:
        count = shards(v, num_ps)
        for _ in range(count):
            pieces.append(Piece(v.name, 1.0 / count, turn % num_ps))
            turn += 1
    return pieces


def balanced_placement(variables: Sequence[Variable], costs: Costs, scenario: Scenario) -> list[Piece]:
    """A placement balanced by each piece's ps time per step (its bytes over the bandwidth and its
    share of the apply's CPU): the same shards as pstrain's, the largest first, each on the ps with
    the least load so far."""
    num_ps = scenario.ps
    parts = [(v, 1.0 / shards(v, num_ps)) for v in variables for _ in range(shards(v, num_ps))]
    parts.sort(key=lambda part: -_piece_load(part[0], part[1], variables, costs, scenario))
    load, pieces = [0.0] * num_ps, []
    for v, fraction in parts:
        target = min(range(num_ps), key=lambda i: (load[i], i))
        load[target] += _piece_load(v, fraction, variables, costs, scenario)
        pieces.append(Piece(v.name, fraction, target))
    return pieces


def _piece_load(v: Variable, fraction: float, variables: Sequence[Variable], costs: Costs, scenario: Scenario) -> float:
    total_push = sum(x.push_bytes for x in variables) or 1.0
    cpu = scenario.workers * costs.ps_gradient_s * v.push_bytes * fraction / total_push
    net = scenario.workers * (v.pull_bytes + v.push_bytes) * fraction / scenario.bandwidth if scenario.bandwidth else 0.0
    return max(cpu, net) + 1e-12 * fraction * v.bytes  # ties: the larger piece first


def predict(costs: Costs, variables: Sequence[Variable], placement: Sequence[Piece], scenario: Scenario) -> Prediction:
    """The step of `scenario` with train.dense = "ps" and the variables placed as `placement` says (see the
    module's docstring)."""
    n, p = scenario.workers, scenario.ps
    pull, push = _on_each_ps(variables, placement, p)
    total_push = sum(v.push_bytes for v in variables)
    shares = [x / total_push if total_push else 1.0 / p for x in push]
    ps_cpu = tuple(costs.ps_base_s + n * costs.ps_request_s + n * costs.ps_gradient_s * s for s in shares)
    ps_bytes = tuple(n * (a + b) for a, b in zip(pull, push, strict=True))
    network = 0.0
    if scenario.bandwidth:
        one_worker = sum(v.pull_bytes + v.push_bytes for v in variables)
        network = max(one_worker, *ps_bytes) / scenario.bandwidth + 2 * scenario.rtt_s
    loads = {"worker compute": _worker_s(costs, scenario), "ps CPU": max(ps_cpu), "ps network": network}
    if scenario.bandwidth:  # in series: the pulls before the forward pass, the pushes after the backward
        loads["worker compute + network"] = loads["worker compute"] + network
    return _roofline(costs, scenario, loads, ps_cpu, ps_bytes)


def allreduce_refusal(variables: Sequence[Variable], num_ps: int) -> str:
    """Why train.dense = "allreduce" refuses the job's variables on `num_ps` ps (chief/step/hybrid.py
    `refusal`: no dense variable to replicate, or a dense one split over ps), or "" where it takes them."""
    dense = [v for v in variables if not v.row_sparse]
    if not dense:
        return "the model has no dense trainable variable to replicate"
    if split := [v.name for v in dense if shards(v, num_ps) > 1]:
        return f"the dense variable {split[0].removesuffix(':0')} would be split over {num_ps} ps; it takes --ps 1"
    return ""


def predict_allreduce(
    costs: Costs,
    variables: Sequence[Variable],
    placement: Sequence[Piece],
    scenario: Scenario,
    slots: int,
    block: int,
    hybrid: HybridCosts | None = None,
) -> Prediction:
    """The step of `scenario` with train.dense = "allreduce" (docs/design.md, the hybrid step): the
    worker's and the ps's CPU from `hybrid`, fitted on measured hybrid runs (`fit_allreduce`), the
    chief's and the worker's cost per example from `costs`, fitted on "ps" runs. Call it only where
    `allreduce_refusal` is "".

    - The tables (`Variable.row_sparse`) are pulled, pushed and applied on the ps as with "ps"; each ps
      still takes one request per worker per step (the loss, the tables, the step gate; with no table,
      the read of the stop request, off the step's path: worker/replica/loop.py `lean_loop`).
    - The dense variables' bytes leave the ps but for the write-back: one worker writes its copies
      and their `slots` optimizer slots back once per `block` (K) steps, `bytes * (1 + slots) / block`
      per step.
    - **ps CPU**: with `hybrid`, as its runs measured it on one ps, `hybrid.ps_base_s` on each ps and
      `hybrid.ps_worker_s` per worker, split over the ps as the tables' rows are (evenly without a
      table). Measured on one ps only: that every ps pays the fixed part (the step gate and the
      write-back are in it, though they reach one ps) and that the per-worker part follows the table
      rows (its requests follow them too) are assumptions. Without `hybrid`: the "ps" fit's fixed and
      per-request costs, and the write-back and the tables at its per-byte cost.
    - **worker compute**: its share of the batch and its requests to the ps as with "ps", plus
      `hybrid.base_s` (its copies' update) and `hybrid.ring_s` per further worker (the exchange's CPU:
      each gradient received, sent on and added). Measured on 1 and 2 workers, where the 2 workers sum
      with a CollectiveReduceV2; 3 or more gather (CollectiveGatherV2, RingGather: N - 1 ring steps of a
      whole gradient each) and are charged `ring_s` per ring step, an extrapolation. Without `hybrid`
      (no hybrid run measured): the ps's per-byte cost of the dense share, N gradients' worth (an
      assumption that leaves out the exchange's CPU).
    - **worker network**: its own tables' pulls and pushes, then the exchange: each worker sends N - 1
      dense gradients' bytes and receives as many (2 workers: half of one, twice, each way), both ways
      at once (a ring sends while it receives: a 40 MiB exchange between two 1 Gbit hosts takes
      1.1-1.45x one way's time, tests/benchmarks/links.py `gather`), so they are counted once, plus a
      round trip per ring step (2 workers' all-reduce: two, its reduce and its gather). The tables'
      pulls and pushes are separate phases of the step and are summed. With one worker, or no dense
      variable, there is no exchange.
    - The worker's compute and its network are in series: the exchange takes the step's gradient,
      and the next step's forward pass takes the updated copies. Two workers send each gradient of
      1 MiB or more as soon as it is made (worker/replica/allreduce.py `summed_mean`), so the rest of
      the backward pass overlaps the exchange there, which this leaves out (it over-predicts by at most
      that rest).
      On a link they bind as one, `worker compute + network`, over the busier of the worker's port and
      the ps's (every worker's table rows); on loopback the exchange's copies are in its CPU."""
    n, p = scenario.workers, scenario.ps
    tables = [v for v in variables if v.row_sparse]
    dense = [v for v in variables if not v.row_sparse]
    pull, push = _on_each_ps(tables, placement, p)
    _, held = _on_each_ps(dense, placement, p)
    written = [x * (1 + slots) / block for x in held]  # the dense variables' push bytes are their full size
    total_push = sum(v.push_bytes for v in variables) or 1.0
    if hybrid is None:
        ps_cpu = tuple(
            costs.ps_base_s + n * costs.ps_request_s + costs.ps_gradient_s * (n * b + w) / total_push
            for b, w in zip(push, written, strict=True)
        )
    else:  # each worker's part split as the tables' rows are (a ps each, evenly, without a table)
        shares = [b / sum(push) for b in push] if sum(push) else [1.0 / p] * p
        ps_cpu = tuple(hybrid.ps_base_s + n * hybrid.ps_worker_s * share for share in shares)
    ps_bytes = tuple(n * (a + b) + w for a, b, w in zip(pull, push, written, strict=True))
    dense_bytes = sum(v.push_bytes for v in dense)
    ring = n - 1 if dense else 0  # ring steps of the exchange (none without a dense variable)
    if hybrid is None:
        worker = _worker_s(costs, scenario) + n * costs.ps_gradient_s * dense_bytes / total_push
    else:
        share = costs.worker_example_s * scenario.batch / n + costs.worker_per_ps_s * (p - 1)
        worker = hybrid.base_s + share + hybrid.ring_s * ring
    ps_network = worker_network = 0.0
    if scenario.bandwidth:
        ps_network = max(ps_bytes) / scenario.bandwidth + 2 * scenario.rtt_s
        own = sum(v.pull_bytes + v.push_bytes for v in tables)
        trips = 2 if n == 2 and dense else ring  # an all-reduce's reduce and gather; a gather's ring steps
        worker_network = (own + ring * dense_bytes) / scenario.bandwidth + trips * scenario.rtt_s
    loads = {"worker compute": worker, "ps CPU": max(ps_cpu), "ps network": ps_network, "worker network": worker_network}
    if scenario.bandwidth:
        loads["worker compute + network"] = worker + max(worker_network, ps_network)
    return _roofline(costs, scenario, loads, ps_cpu, ps_bytes)


def choose_dense(ps: Prediction, allreduce: Prediction | None, margin: float = 0.05) -> str:
    """train.dense for a scenario: "allreduce" where it is predicted more than `margin` faster than
    "ps" (the default, and the mode the costs were measured in), else "ps"; "ps" where `allreduce` is
    None (refused)."""
    return "allreduce" if allreduce is not None and allreduce.step_s < ps.step_s * (1 - margin) else "ps"


def _on_each_ps(variables: Sequence[Variable], placement: Sequence[Piece], num_ps: int) -> tuple[list[float], list[float]]:
    """(pull, push) bytes per ps of one worker, for the pieces of `variables` in `placement`."""
    by_name = {v.name: v for v in variables}
    push, pull = [0.0] * num_ps, [0.0] * num_ps
    for piece in placement:
        if (v := by_name.get(piece.name)) is not None:
            push[piece.ps] += v.push_bytes * piece.fraction
            pull[piece.ps] += v.pull_bytes * piece.fraction
    return pull, push


def _worker_s(costs: Costs, scenario: Scenario) -> float:
    n = scenario.workers
    return costs.worker_base_s + costs.worker_example_s * scenario.batch / n + costs.worker_per_ps_s * scenario.ps


def _roofline(costs: Costs, scenario: Scenario, loads: dict[str, float], ps_cpu: tuple, ps_bytes: tuple) -> Prediction:
    """`loads` with the chief's and (tasks sharing cores) the shared cores' added; the largest binds."""
    n, p = scenario.workers, scenario.ps
    chief = costs.chief_base_s + costs.chief_per_worker_s * n + (costs.chief_sharded_s if p > 1 else 0.0)
    loads["chief"] = chief + costs.chief_per_ps_s * (p - 1)
    if scenario.cores:
        loads["shared cores"] = (n * loads["worker compute"] + sum(ps_cpu) + loads["chief"]) / scenario.cores
    binding = max(loads, key=lambda k: loads[k])
    step = loads[binding]
    return Prediction(step, scenario.batch / step, binding, loads, ps_cpu, ps_bytes)


def propose_ps(costs: Costs, variables: Sequence[Variable], scenario: Scenario, most: int = 64) -> tuple[int, Prediction]:
    """The fewest ps (1..most) whose predicted step, with the balanced placement, is within 5 % of the
    best over that range; with its prediction."""
    results = []
    for p in range(1, most + 1):
        trial = Scenario(scenario.workers, p, scenario.batch, scenario.bandwidth, scenario.rtt_s, scenario.cores)
        results.append((p, predict(costs, variables, balanced_placement(variables, costs, trial), trial)))
    best = min(r.step_s for _, r in results)
    return next((p, r) for p, r in results if r.step_s <= best * 1.05)
