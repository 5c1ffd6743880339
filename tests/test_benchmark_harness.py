"""The benchmark command runs every peer end to end (a smoke run: tiny model, few steps).

Nothing here asserts a speed: figures come from the full benchmark, run by hand (README).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmarks.bench import PEERS
from tests.helpers import ROOT

pytestmark = pytest.mark.cluster  # starts real processes (not in the fast tier)


def test_benchmark_command_runs_every_peer(tmp_path):
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "tests.benchmarks.bench", "--sizes", "1m", "--repeats", "1", "--steps", "5"]
    result = subprocess.run(argv + ["--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]["1m"]
    assert set(runs) == {*PEERS, "transfer", "breakdown"}
    assert all(run[0]["step_s"] > 0 for peer, run in runs.items() if peer != "breakdown")
    phases = runs["breakdown"][0]["phases_s"]
    assert list(phases) == ["dispatch", "pull", "compute", "push"]
    assert abs(sum(phases.values()) - runs["breakdown"][0]["to_nth_s"]) < 1e-9
    assert "| pstrain sync, 2 workers |" in result.stdout and "× the limit" in result.stdout
    assert "time to the N-th gradient by phase" in result.stdout


def test_embedding_benchmark_runs_every_peer(tmp_path):
    out = tmp_path / "emb.json"
    argv = [sys.executable, "-m", "tests.benchmarks.embeddings", "--sizes", "1m", "--repeats", "1", "--steps", "5"]
    result = subprocess.run(argv + ["--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]["1m"]
    assert set(runs) == {"pstrain", "async", "tf1", "single", "transfer"}
    assert all(run[0]["step_s"] > 0 for run in runs.values())
    assert runs["transfer"][0]["rows_per_slot"] > 0 and "rows touched per slot" in result.stdout


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
