"""The benchmark commands run every peer end to end (a smoke run: small models, few steps), each as its name says.

Nothing here asserts a speed: figures come from the full benchmark, run by hand (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.benchmarks.bench import PEERS, PROBES
from tests.benchmarks.drawn import DRAWN
from tests.benchmarks.embeddings import PEERS as EMBEDDING_PEERS
from tests.benchmarks.fair import PER_DISPATCH, chunks
from tests.benchmarks.recsys import PEERS as RECSYS_PEERS
from tests.benchmarks.recsys import tower_parameters
from tests.benchmarks.rounds import shuffled
from tests.benchmarks.window import measure
from tests.helpers import ROOT, Result, assert_no_orphans, descendant_pids

pytestmark = pytest.mark.cluster


# A smoke run's K sweep: two values, both within its steps, on the dense workload, where the choice of the
# fastest is proven; one K on the others (no sweep runs: tests/benchmarks/rounds.py), run at that K.
SWEEP, ONE_K = (2, 4), (2,)


def run_command(tmp_path, module: str, size: str, steps: int, sweep: tuple[int, ...]) -> tuple[str, dict, object]:
    """A benchmark command on one size, one measured round, no warm-up round, the K sweep `sweep`: its
    stdout, its JSON, and the folder where each TF1 worker wrote its run count."""
    out, runs_dir = tmp_path / "bench.json", tmp_path / "tf1-runs"
    runs_dir.mkdir()
    argv = [sys.executable, "-m", module, "--sizes", size, "--repeats", "1", "--warmup-rounds", "0", "--steps", str(steps)]
    argv += ["--sweep", ",".join(map(str, sweep)), "--out", str(out)]
    env = {**os.environ, "BENCH_RUNS_DIR": str(runs_dir)}  # each TF1 worker's run count
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1500, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, json.loads(out.read_text()), runs_dir


def assert_each_peer_ran_as_named(stdout: str, data: dict, size: str, steps: int, runs_dir, sweep: tuple[int, ...]) -> dict:
    """Every peer of a workload ran as its name says: data made on the workers, fresh batches (the
    workloads' draws: test_benchmark_rounds.py), one join, the K in use (swept over `sweep`); returns
    the runs by peer."""
    runs = {peer: rs[0] for peer, rs in data["runs"][size].items()}
    rounds = data["rounds"][size]
    assert set(runs) == {*PEERS, *PROBES} and data["failed"][size] == {}, data["failed"]
    for peer, run in runs.items():  # one timing definition: recomputed from each peer's own samples
        assert run == {**run, **measure(run["samples"], steps, run["t_launch"])}, peer
        assert run["window"][1] >= steps and run["step_s"] > 0 and run["startup_s"] > 0, (peer, run["window"])
        assert f"  {peer}: {run['setup']}" in stdout  # how each peer ran, printed
        assert data["summary"][size][peer]["step_s"]["median"] == run["step_s"]
    assert rounds["orders"][0] == shuffled([*PEERS, *PROBES], 0, 1) and "orders (seed 0" in stdout
    # The K in use: each tuned peer ran every K of the sweep, and the rounds ran it at its fastest.
    # One K: no sweep runs, the rounds ran that K.
    for peer, key in (("async", "per_closure"), ("mwms", "per_call")):
        swept = {int(k): s for k, s in rounds["sweep"].get(peer, {}).items()}
        best = min(swept, key=swept.get) if len(sweep) > 1 else sweep[0]
        assert sorted(swept) == list(sweep if len(sweep) > 1 else ()) and rounds["k"][peer] == best == runs[peer][key], peer
    assert f"async K={sweep[0]}" in stdout
    assert ("K swept: " if len(sweep) > 1 else f"K not swept ({sweep[0]} for the tuned peers)") in stdout
    # Tuned async: K steps per closure, every closure after the first round before one join; every
    # update applied. One step per closure: a join after each global step.
    tuned, k = runs["async"], rounds["k"]["async"]
    assert tuned["closures"] == 2 * len(chunks(steps, k)) and tuned["iterations"] == 2 * steps
    assert runs["async-1step"]["per_closure"] == 1 and runs["async-1step"]["closures"] == 2 * steps
    assert runs["single"]["per_call"] == PER_DISPATCH
    # pstrain: its examples drawn on the workers (a train_dataset() read there by position); one sample
    # per block (1 step, then K = 64 > steps - 1: one more), so its gaps count; K = 1 a sample per step.
    assert all(DRAWN in runs[p]["setup"] for p in ("pstrain", "pstrain-k1"))
    assert [s[0] for s in runs["pstrain"]["samples"]] == [1, steps]
    # The transfer limit both ways: a join every step, and 16 moves per closure (one sample per closure).
    looped = runs["transfer-looped"]
    assert [s[0] for s in looped["samples"]] == [1, 17, steps] and "16 steps per closure" in looped["setup"]
    # TF1: one update per global step from N = 2 gradients: both workers' runs, about twice the steps
    # (an apply per gradient would make the global step the sum of the runs); no Keras in its processes.
    # The chief fills the token queue with N tokens, so a worker may take both and push both gradients
    # of a step while the other is still starting: one that never ran wrote no count, 0 runs.
    counts = [runs_dir / f"worker-{i}" for i in range(2)]
    total = sum(int(path.read_text()) if path.exists() else 0 for path in counts)
    assert 2 * steps <= total <= 2 * (steps + 3), (total, runs["tf1"]["window"])
    assert runs["tf1"]["tf_keras_loaded"] is False
    # MWMS: the workers made different batches, moved their weights, and still hold the same: all-reduced.
    first, second = runs["mwms"]["reports"]
    assert first["data_digest"] != second["data_digest"] and first["initial_sums"] == second["initial_sums"]
    assert first["sums"] == pytest.approx(second["sums"], rel=1e-7, abs=1e-9), (first["sums"], second["sums"])
    moved = [abs(a - b) for a, b in zip(first["sums"], first["initial_sums"], strict=True)]
    # At least three variables moved by far more than the tolerance above (10,000x its absolute part;
    # a logits' bias sums a softmax gradient, zero by construction, so its sum barely moves).
    assert sum(m > 1e-5 for m in moved) >= 3, moved
    return runs


def test_benchmark_command_runs_every_peer_as_its_name_says(tmp_path):
    steps = 20
    stdout, data, runs_dir = run_command(tmp_path, "tests.benchmarks.bench", "1m", steps, SWEEP)
    runs = assert_each_peer_ran_as_named(stdout, data, "1m", steps, runs_dir, SWEEP)
    phases = runs["pstrain"]["startup_phases"]  # the chief's start-up, from its log
    assert "process start and imports" in phases and "first step" in phases and all(v >= 0 for v in phases.values())
    assert sum(phases.values()) <= runs["pstrain"]["startup_s"] + 1.0, "the chief's phases fit in launch to first step"
    assert "| pstrain sync, 2 workers |" in stdout and "transfer-looped " in stdout
    assert "| pstrain sync, 2 workers, 1 step per dispatch |" in stdout
    assert "pstrain launch to first step" in stdout


def test_embedding_benchmark_runs_every_peer_as_its_name_says(tmp_path):
    steps = 20
    stdout, data, runs_dir = run_command(tmp_path, "tests.benchmarks.embeddings", "1m", steps, ONE_K)
    runs = assert_each_peer_ran_as_named(stdout, data, "1m", steps, runs_dir, ONE_K)
    assert runs["transfer"]["rows_per_slot"] > 0 and "rows touched per slot" in stdout


def test_recommender_benchmark_runs_every_peer_as_its_name_says(tmp_path):
    steps = 20
    stdout, data, runs_dir = run_command(tmp_path, "tests.benchmarks.recsys", "tiny", steps, ONE_K)
    runs = assert_each_peer_ran_as_named(stdout, data, "tiny", steps, runs_dir, ONE_K)
    assert data["workload"]["tiny"] == {"tables": [1_600, 400], "dim": 64, "tower_parameters": tower_parameters("tiny")}
    assert runs["transfer"]["rows_per_slot"] > 0 and "tables 1,600 + 400 rows x 64" in stdout


def test_embedding_scaling_runs_pstrain_and_tf1_at_every_worker_count(tmp_path):
    out = tmp_path / "scaling.json"
    argv = [sys.executable, "-m", "tests.benchmarks.embeddings", "--sizes", "", "--repeats", "1", "--steps", "4", "--scaling"]
    argv += ["--scaling-workers", "1,4"]  # the command's default is 1,2,4,8: a smoke run keeps it short
    result = subprocess.run(argv + ["--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = json.loads(out.read_text())["scaling"]
    assert {peer: sorted(map(int, by_n)) for peer, by_n in runs.items()} == {"pstrain": [1, 4], "tf1": [1, 4]}
    assert "step at 4 workers ÷ at 1: pstrain" in result.stdout


def test_benchmark_data_section_runs_every_source(tmp_path):
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "tests.benchmarks.bench", "--sizes", "", "--repeats", "1", "--steps", "5", "--data"]
    argv += ["--data-gb", "0.005", "--data-files", "300", "--data-dir", str(tmp_path / "data"), "--out", str(out)]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = json.loads(out.read_text())["data"]
    assert len(runs) == 5 and all(r[0]["step_s"] > 0 and r[0]["startup_s"] > 0 for r in runs.values())
    # (d) reads its files ahead, (e) is the same with read-ahead off; the arrays are not read ahead.
    ahead = {name[0]: r[0].get("read_ahead") for name, r in runs.items()}
    assert ahead["d"] is not None and 0 <= ahead["d"] <= 1 and ahead["e"] is None and ahead["a"] is None
    assert "| (c) large .npy on the workers (train_arrays) |" in result.stdout


def test_loop_profile_prints_the_step_time_and_an_op_table():
    argv = [sys.executable, "-m", "tests.benchmarks.loop_profile", "--workers", "1", "--blocks", "3", "--per-execution", "2"]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1 workers, K=2:" in result.stdout and "ms/step" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and not line.startswith("| op type")]
    assert any(row.startswith("| _Send |") for row in rows), result.stdout  # the loop's body spans worker and ps


def test_cpu_split_prints_each_roles_cpu_per_step_for_pstrain_and_tf1():
    argv = [sys.executable, "-m", "tests.benchmarks.cpu_split", "--steps", "400", "--warmup", "60", "--window", "1"]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in result.stdout.splitlines() if line.startswith("| ")}
    pstrain = {role: float(cells[0]) for role, cells in rows.items() if role not in ("role",) and cells[0].strip() != "—"}
    tf1 = {role: float(cells[1]) for role, cells in rows.items() if role not in ("role",) and cells[1].strip() != "—"}
    assert {"chief", "ps 0", "worker 0", "worker 1", "all roles", "wall ms/step", "cores busy"} <= set(pstrain), result.stdout
    assert {"ps 0", "worker 0", "worker 1", "all roles"} <= set(tf1) and "chief" not in tf1, result.stdout
    assert all(pstrain[r] > 0 and tf1[r] > 0 for r in ("ps 0", "worker 0", "wall ms/step")), result.stdout


def test_every_workload_has_the_same_peers():
    assert PEERS == EMBEDDING_PEERS == RECSYS_PEERS


def test_the_private_network_ab_runs_pstrain_both_ways_and_records_it(tmp_path):
    """Issue 38's A/B (docs/benchmarks.md): `pstrain-open` beside `pstrain`, and --no-private-network
    for a whole invocation; each run says, from its own cluster.json, which way it ran."""
    out = tmp_path / "ab.json"
    argv = [
        sys.executable,
        "-m",
        "tests.benchmarks.bench",
        "--sizes",
        "1m",
        "--repeats",
        "1",
        "--warmup-rounds",
        "0",
        "--steps",
        "5",
    ]
    ab = subprocess.run(
        argv + ["--peers", "pstrain,pstrain-open", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert ab.returncode == 0, ab.stdout[-3000:] + ab.stderr[-3000:]
    results = json.loads(out.read_text())
    runs = results["runs"]["1m"]
    assert results["private_network"] is True and "pstrain's tasks in a private network namespace" in ab.stdout
    assert runs["pstrain"][0]["private_network"] is True and runs["pstrain-open"][0]["private_network"] is False
    assert "| pstrain sync, 2 workers, no private network (TF ports open) |" in ab.stdout
    whole = subprocess.run(
        argv + ["--peers", "pstrain", "--no-private-network", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["private_network"] is False and results["runs"]["1m"]["pstrain"][0]["private_network"] is False


def test_sigterm_on_a_loopback_invocation_stops_every_process_it_started():
    """SIGTERM ends a benchmark as Ctrl-C does: its runs' processes are stopped, exit 143 (it once left
    the role processes running: the handler was set for --link invocations only)."""
    argv = [sys.executable, "-m", "tests.benchmarks.bench", "--sizes", "1m", "--peers", "tf1", "--repeats", "1"]
    bench = subprocess.Popen([*argv, "--steps", "4000", "--warmup-rounds", "0"], cwd=ROOT, stdout=subprocess.DEVNULL)
    seen: set[int] = set()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and bench.poll() is None and len(seen) < 3:  # the ps and both workers
        seen |= descendant_pids([bench.pid])
        time.sleep(0.3)
    assert len(seen) >= 3, "the tf1 peer's processes started"
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=120) == 128 + signal.SIGTERM
    assert_no_orphans(Result(0, "", seen))
