"""The step-at-scale model's arithmetic and decisions (cluster/forecast/model.py), on made-up costs."""

from __future__ import annotations

import pytest

from cluster.forecast.model import (
    Costs,
    HybridCosts,
    Observation,
    Scenario,
    Variable,
    allreduce_refusal,
    balanced_placement,
    choose_dense,
    fit,
    fit_allreduce,
    nonnegative_fit,
    predict,
    predict_allreduce,
    propose_ps,
    pstrain_placement,
    shards,
)

pytestmark = pytest.mark.pure

MS = 1e-3
TABLE = Variable("table", 256 << 20, 1_000_000, 400_000, 400_000, row_sparse=True)  # 400 kB touched per step
KERNEL = Variable("kernel", 16_384, 64, 16_384, 16_384)
BIAS = Variable("bias", 256, 64, 256, 256)


def costs(**changes: float) -> Costs:
    base = dict(
        worker_base_s=2 * MS,
        worker_example_s=0.2 * MS,
        worker_per_ps_s=0.5 * MS,
        ps_base_s=1 * MS,
        ps_request_s=0.2 * MS,
        ps_gradient_s=1 * MS,
        chief_base_s=0.5 * MS,
        chief_per_worker_s=0.01 * MS,
        chief_sharded_s=0.0,
        chief_per_ps_s=0.1 * MS,
        cores=2.0,
    )
    return Costs(**{**base, **changes})


def test_prediction_arithmetic_by_hand():
    c, v = costs(), [TABLE, KERNEL]
    scenario = Scenario(workers=4, ps=1, batch=128, bandwidth=1.25e9, rtt_s=0.1 * MS)
    got = predict(c, v, pstrain_placement(v, 1), scenario)
    worker = 2 + 0.2 * 128 / 4 + 0.5 * 1  # ms
    ps = 1 + 4 * 0.2 + 4 * 1.0
    net = 4 * 2 * (400_000 + 16_384) / 1.25e9 / MS + 2 * 0.1
    chief = 0.5 + 0.04  # one ps: neither the step to two ps nor a cost per further ps
    serial = worker + net  # on a link the pulls, the compute and the pushes run in series
    want = {"worker compute": worker, "ps CPU": ps, "ps network": net, "worker compute + network": serial, "chief": chief}
    assert got.loads == pytest.approx({k: v * MS for k, v in want.items()})
    assert got.binding == "worker compute + network" and got.step_s == pytest.approx(serial * MS)
    assert got.examples_per_s == pytest.approx(128 / (serial * MS))
    on_loopback = predict(c, v, pstrain_placement(v, 1), Scenario(workers=4, ps=1, batch=128, bandwidth=None))
    assert "worker compute + network" not in on_loopback.loads  # the copies are in the measured CPU
    assert on_loopback.binding == "worker compute" and on_loopback.step_s == pytest.approx(worker * MS)


def test_each_resource_can_bind():
    v = [TABLE, KERNEL]

    def binding(c: Costs, bandwidth: float | None = None, workers: int = 4, cores: float | None = None) -> str:
        s = Scenario(workers, 1, 128, bandwidth, cores=cores)
        return predict(c, v, pstrain_placement(v, 1), s).binding

    assert binding(costs()) == "worker compute"
    assert binding(costs(), workers=16) == "ps CPU"  # 1 + 16 * 1.2 ms on the ps against 4.1 ms per worker
    # 1 Gbit: 4 workers' 3.3 MB take 27 ms through the ps's port, after and before 8.9 ms of each worker's compute
    assert binding(costs(), bandwidth=1.25e8) == "worker compute + network"
    idle = costs(worker_base_s=0.0, worker_example_s=0.0, worker_per_ps_s=0.0)
    assert binding(idle, bandwidth=1.25e8) == "ps network"  # the network term alone (workers that cost nothing)
    assert binding(costs(chief_base_s=50 * MS)) == "chief"
    assert binding(costs(), cores=2.0) == "shared cores"  # every task on 2 cores


def test_shards_follow_pstrains_partitioner():
    assert shards(TABLE, 1) == 1 and shards(TABLE, 4) == 4
    assert shards(KERNEL, 4) == 1 and shards(BIAS, 4) == 1  # under 256 KiB: whole
    assert shards(Variable("small_table", 512 << 10, 3, 1, 1), 8) == 2  # at most bytes / 256 KiB
    placed = pstrain_placement([TABLE, KERNEL, BIAS], 2)
    want = [("table", 0.5, 0), ("table", 0.5, 1), ("kernel", 1, 0), ("bias", 1, 1)]
    assert [(p.name, p.fraction, p.ps) for p in placed] == want


def test_balanced_placement_evens_the_ps_and_never_does_worse_than_round_robin():
    big = [Variable(f"v{i}", 200_000, 10, size, size) for i, size in enumerate((200_000, 10, 200_000, 10, 10, 10))]
    c, s = costs(), Scenario(8, 2, 128, 1.25e9)
    rr, balanced = predict(c, big, pstrain_placement(big, 2), s), predict(c, big, balanced_placement(big, c, s), s)
    assert rr.ps_bytes[0] > 1.5 * rr.ps_bytes[1]  # round robin puts both large ones on ps 0
    assert balanced.ps_bytes[0] == pytest.approx(balanced.ps_bytes[1], rel=0.01)
    assert balanced.step_s < rr.step_s


def test_propose_ps_takes_the_fewest_near_the_best():
    c, v = costs(worker_example_s=0.0, worker_per_ps_s=0.0), [TABLE]
    count, best = propose_ps(c, v, Scenario(16, 1, 128, None), most=16)
    # the table in P equal shards: each ps spends 1 + 16 * 0.2 + 16 / P ms, against 2 ms per worker, so the
    # ps binds at every P; the best (P = 16) is 5.2 ms, and 16 / P <= 5.46 - 4.2 first holds at P = 13
    assert count == 13 and best.binding == "ps CPU"
    assert best.step_s == pytest.approx((4.2 + 16 / 13) * MS)
    few, _ = propose_ps(costs(ps_gradient_s=0.0), v, Scenario(16, 1, 128, None), most=8)
    assert few == 1  # nothing on the ps scales with its count: one is enough


def ps_runs(truth: Costs) -> list[Observation]:
    """The five runs `pstrain plan` measures by default, as `truth` predicts them (train.dense = "ps")."""
    runs = []
    for workers, num_ps in ((1, 1), (2, 1), (1, 2), (2, 2), (1, 4)):
        s = Scenario(workers, num_ps, 64, None, cores=truth.cores)
        p = predict(truth, [KERNEL], pstrain_placement([KERNEL], num_ps), s)
        cpu = {"worker": workers * p.loads["worker compute"], "ps": sum(p.ps_cpu_s), "chief": p.loads["chief"]}
        runs.append(Observation(workers, num_ps, 64, p.step_s, cpu))
    return runs


def test_fit_recovers_the_costs_that_made_the_runs():
    truth = costs(chief_per_worker_s=0.0, chief_sharded_s=3 * MS)
    runs = ps_runs(truth)
    got = fit(runs)
    assert got.worker_base_s == pytest.approx(truth.worker_base_s, rel=1e-6)
    assert got.worker_example_s == pytest.approx(truth.worker_example_s, rel=1e-6)
    assert got.ps_base_s == pytest.approx(truth.ps_base_s, rel=1e-6)
    assert got.ps_request_s == pytest.approx(truth.ps_request_s, rel=1e-6)
    assert got.ps_gradient_s == pytest.approx(truth.ps_gradient_s, rel=1e-6)
    assert got.chief_per_ps_s == pytest.approx(truth.chief_per_ps_s, rel=1e-6)
    assert got.chief_sharded_s == pytest.approx(truth.chief_sharded_s, rel=1e-6)  # told apart by the run on 4 ps
    assert 1.0 < got.cores <= truth.cores  # the cores kept busy: all 2 where they bound, fewer where one worker did


def test_fit_refuses_runs_that_cannot_separate_the_costs():
    one = Observation(2, 1, 64, 0.01, {"worker": 0.01, "ps": 0.005, "chief": 0.001})
    with pytest.raises(ValueError, match="two worker counts and two ps counts"):
        fit([one, Observation(4, 1, 64, 0.02, one.cpu_s)])


def test_nonnegative_fit_drops_a_column_that_would_go_negative():
    import numpy as np

    x = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0])  # falls with the second column: its coefficient is held at 0
    coef = nonnegative_fit(x, y)
    assert coef[1] == 0 and coef[0] == pytest.approx(2.0)


def allreduce(c: Costs, v: list[Variable], s: Scenario, slots: int = 2, block: int = 64):
    return predict_allreduce(c, v, pstrain_placement(v, s.ps), s, slots, block)


def test_allreduce_of_dense_variables_only_leaves_the_ps_the_write_back():
    c, v = costs(), [KERNEL, BIAS]
    s = Scenario(workers=4, ps=1, batch=128, bandwidth=1.25e9, rtt_s=0.1 * MS)
    got, by_ps = allreduce(c, v, s), predict(c, v, pstrain_placement(v, 1), s)
    dense = 16_384 + 256
    written = dense * (1 + 2) / 64  # the copies and Adam's two slots, once per block of 64 steps
    assert got.ps_bytes == pytest.approx((written,)) and by_ps.ps_bytes == pytest.approx((4 * 2 * dense,))
    # the ps keeps its fixed and per-request costs, and applies only the write-back's bytes
    assert got.loads["ps CPU"] == pytest.approx((1 + 4 * 0.2 + 1.0 * written / dense) * MS)
    # each worker sums the 4 gathered gradients and applies them: the ps's per-gradient cost, 4 gradients' worth
    assert got.loads["worker compute"] == pytest.approx((2 + 0.2 * 128 / 4 + 0.5 + 4 * 1.0) * MS)
    # the ring gather: 3 gradients sent and 3 received at once, in 3 ring steps (the slot rides in the row)
    assert got.loads["worker network"] == pytest.approx(3 * dense / 1.25e9 + 3 * 0.1 * MS)
    # in series with the worker's compute: the exchange takes the step's gradient, the next step the copies
    serial = got.loads["worker compute"] + got.loads["worker network"]
    assert got.loads["worker compute + network"] == pytest.approx(serial)
    assert got.binding == "worker compute + network" and got.step_s == pytest.approx(serial)
    assert got.loads["ps network"] == pytest.approx(written / 1.25e9 + 2 * 0.1 * MS)
    assert got.loads["chief"] == by_ps.loads["chief"]


def test_allreduce_of_a_table_alone_exchanges_nothing_and_is_refused():
    c, v = costs(), [TABLE]
    s = Scenario(workers=4, ps=1, batch=128, bandwidth=1.25e9, rtt_s=0.1 * MS)
    got, by_ps = allreduce(c, v, s), predict(c, v, pstrain_placement(v, 1), s)
    assert got.loads["worker network"] == pytest.approx(2 * 400_000 / 1.25e9)  # its own rows, no ring
    assert got.ps_bytes == pytest.approx(by_ps.ps_bytes) and got.ps_cpu_s == pytest.approx(by_ps.ps_cpu_s)
    assert got.loads["worker compute"] == pytest.approx(by_ps.loads["worker compute"])
    assert allreduce_refusal(v, 1) == "the model has no dense trainable variable to replicate"


def test_allreduce_with_one_worker_has_no_exchange():
    c, v = costs(), [TABLE, KERNEL]
    got = allreduce(c, v, Scenario(workers=1, ps=1, batch=128, bandwidth=1.25e9, rtt_s=0.1 * MS))
    assert got.loads["worker network"] == pytest.approx(2 * 400_000 / 1.25e9)  # the table's rows: no gather, no ring step
    assert allreduce(c, v, Scenario(1, 1, 128, None)).loads["worker network"] == 0.0


def test_allreduce_takes_the_tables_and_the_dense_bytes_apart():
    c, v = costs(), [TABLE, KERNEL]
    s = Scenario(workers=8, ps=2, batch=128, bandwidth=1.25e9)
    got = allreduce(c, v, s, slots=1, block=16)
    total = 400_000 + 16_384
    # the table in two shards, one on each ps; the kernel on ps 0 (round robin), written back every 16 steps
    half, written = 200_000, 16_384 * 2 / 16
    assert got.ps_bytes == pytest.approx((8 * 2 * half + written, 8 * 2 * half))
    want = [1 + 8 * 0.2 + 1.0 * (8 * half + written) / total, 1 + 8 * 0.2 + 1.0 * 8 * half / total]
    assert got.ps_cpu_s == pytest.approx(tuple(x * MS for x in want))
    assert got.loads["worker compute"] == pytest.approx((2 + 0.2 * 16 + 0.5 * 2 + 8 * 1.0 * 16_384 / total) * MS)
    assert got.loads["worker network"] == pytest.approx((2 * 400_000 + 7 * 16_384) / 1.25e9)


def test_allreduce_is_refused_where_a_dense_variable_would_be_split_and_chosen_only_where_faster():
    wide = Variable("wide/kernel:0", 1 << 20, 1024, 1 << 20, 1 << 20)
    assert allreduce_refusal([TABLE, wide], 1) == ""
    assert allreduce_refusal([TABLE, wide], 2) == "the dense variable wide/kernel would be split over 2 ps; it takes --ps 1"
    c, v = costs(), [TABLE, wide]
    # 16 workers on 1 ps: the ps applies 16 gradients per step; the hybrid moves the wide layer's share to the workers
    s = Scenario(16, 1, 128, None)
    by_ps, hybrid = predict(c, v, pstrain_placement(v, 1), s), allreduce(c, v, s)
    assert by_ps.binding == "ps CPU" and hybrid.step_s < by_ps.step_s * 0.95
    assert choose_dense(by_ps, hybrid) == "allreduce" and choose_dense(by_ps, None) == "ps"
    # on a 1 Gbit link with 4 ps each ps carries a quarter of the dense bytes, 16 workers' worth (51 ms), while
    # each worker's link carries 15 workers' gradients of all four each way (96 ms) after its compute: "ps" is kept
    layers = [Variable(f"layer{i}", 200_000, 100, 200_000, 200_000) for i in range(4)]
    slow = Scenario(16, 4, 128, 1.25e8)
    by_ps, hybrid = predict(c, layers, pstrain_placement(layers, 4), slow), allreduce(c, layers, slow)
    assert by_ps.loads["ps network"] == pytest.approx(16 * 2 * 200_000 / 1.25e8)
    exchange = 15 * 800_000 / 1.25e8
    assert hybrid.binding == "worker compute + network"
    assert hybrid.step_s == pytest.approx(hybrid.loads["worker compute"] + exchange)
    assert choose_dense(by_ps, hybrid) == "ps"


def test_the_plan_predicts_both_modes_per_scenario_or_says_why_not():
    from cluster.forecast.command import both_modes
    from cluster.forecast.variables import JobBytes

    wide = Variable("wide/kernel:0", 1 << 20, 1024, 1 << 20, 1 << 20)  # split on 2 ps: "allreduce" refused there
    scenarios = [Scenario(16, 1, 128, 1.25e9), Scenario(16, 2, 128, 1.25e9)]
    rows, modes, lines = both_modes(costs(), JobBytes([TABLE, wide], "", 2), scenarios, 64)
    assert modes == ["ps", "allreduce", "ps"] and [(w, p) for w, p, _ in rows] == [(16, 1), (16, 1), (16, 2)]
    assert rows[1][2] == allreduce(costs(), [TABLE, wide], scenarios[0], slots=2, block=64)
    assert lines[0].startswith('  16 workers, 1 ps: train.dense = "allreduce" ("allreduce" ')
    split = "the dense variable wide/kernel would be split over 2 ps; it takes --ps 1"
    assert lines[1].endswith(f'"allreduce" is refused there: {split}')
    refused = JobBytes([TABLE, wide], 'train.dense = "allreduce" takes tf_keras models only (the job uses Keras 3): ...', 0)
    rows, modes, lines = both_modes(costs(), refused, scenarios, 64)
    assert modes == ["ps", "ps"] and lines == []  # the launch's own line is printed once, for the job


def test_the_hybrid_worker_is_charged_what_its_measured_runs_fitted():
    c, v = costs(), [TABLE, KERNEL]
    hybrid = HybridCosts(base_s=3 * MS, ring_s=4 * MS, ps_base_s=1.5 * MS, ps_worker_s=0.6 * MS)
    s = Scenario(workers=8, ps=2, batch=128, bandwidth=1.25e8, rtt_s=0.1 * MS)
    got = predict_allreduce(c, v, pstrain_placement(v, 2), s, 2, 64, hybrid)
    # each ps its fixed part, and the 8 workers' part split as the table's rows are (in halves)
    assert got.ps_cpu_s == pytest.approx(((1.5 + 8 * 0.6 / 2) * MS,) * 2)
    dense_only = predict_allreduce(c, [KERNEL, BIAS], pstrain_placement([KERNEL, BIAS], 2), s, 2, 64, hybrid)
    assert dense_only.ps_cpu_s == pytest.approx(((1.5 + 8 * 0.6 / 2) * MS,) * 2)  # no table: evenly
    # its fixed work and copies' update, its share of the batch, the second ps's requests, 7 ring steps
    worker = (3 + 0.2 * 128 / 8 + 0.5 * 1 + 4 * 7) * MS
    assert got.loads["worker compute"] == pytest.approx(worker)
    network = (2 * 400_000 + 7 * 16_384) / 1.25e8 + 7 * 0.1 * MS
    assert got.loads["worker network"] == pytest.approx(network)
    # each ps's port carries 8 workers' halves of the table rows both ways (and one ps the kernel's
    # write-back with Adam's 2 slots once per 64 steps), more than a worker's port: the step's
    # transfers wait on it, in series with the compute
    ps_port = (8 * 2 * 400_000 / 2 + 16_384 * 3 / 64) / 1.25e8 + 2 * 0.1 * MS
    assert got.loads["ps network"] == pytest.approx(ps_port) and ps_port > network
    assert got.loads["worker compute + network"] == pytest.approx(worker + ps_port)
    alone = predict_allreduce(c, v, pstrain_placement(v, 1), Scenario(1, 1, 128, None), 2, 64, hybrid)
    assert alone.loads["worker compute"] == pytest.approx((3 + 0.2 * 128) * MS)  # no ring step, no second ps
    assert "worker compute + network" not in alone.loads  # loopback: the exchange's copies are in its CPU


def test_fit_allreduce_recovers_the_hybrid_costs_and_fit_leaves_the_hybrid_runs_out():
    truth, hybrid = costs(chief_per_worker_s=0.0, chief_sharded_s=3 * MS), HybridCosts(5 * MS, 7 * MS, 2 * MS, 0.5 * MS)
    runs = ps_runs(truth)
    for workers in (1, 2):
        s = Scenario(workers, 1, 64, None, cores=truth.cores)
        p = predict_allreduce(truth, [KERNEL], pstrain_placement([KERNEL], 1), s, 2, 64, hybrid)
        cpu = {"worker": workers * p.loads["worker compute"], "ps": sum(p.ps_cpu_s), "chief": 100.0}  # spoils "ps"'s fit
        runs.append(Observation(workers, 1, 64, p.step_s, cpu, dense="allreduce"))
    got = fit(runs)
    assert got.ps_base_s == pytest.approx(truth.ps_base_s, rel=1e-6) and got.chief_base_s == pytest.approx(truth.chief_base_s)
    found = fit_allreduce(got, runs)
    for name in ("base_s", "ring_s", "ps_base_s", "ps_worker_s"):
        assert getattr(found, name) == pytest.approx(getattr(hybrid, name), rel=1e-6), name
    with pytest.raises(ValueError, match='train.dense = "allreduce" and at least two worker counts'):
        fit_allreduce(got, [r for r in runs if r.workers == 2])
