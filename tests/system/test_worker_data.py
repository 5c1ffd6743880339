"""Data that lives on the workers (worker/input/sources.py): read where it is used, addressed by (step, slot).

Each source must train a 2-worker cluster to the standalone run's model (1e-4): PNG files read with
tf.io.decode_png, the job's own .npy files (the fast path), one file per example; a run resumed from
a checkpoint lands on the same examples; a worker's memory does not grow with a file-per-example set.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import psutil
import pytest

from chief.jobs import digits
from tests.helpers import (
    assert_both_workers_each_step,
    assert_no_orphans,
    kill_task_when,
    lost_worker_warning,
    metrics,
    predictions,
    run_pstrain,
    step_lines,
    task_pid,
)
from tests.jobs.data_jobs import FILE_INPUTS, write_example_files

pytestmark = pytest.mark.cluster

STEPS = 30  # digits: enough to move the model far from its start, short enough for CI


@pytest.fixture(scope="module")
def data_env(tmp_path_factory) -> dict[str, str]:
    return {"PSTRAIN_DATA_DIR": str(tmp_path_factory.mktemp("data-cache"))}


@pytest.fixture(scope="module")
def array_reference(tmp_path_factory):
    """The array job (train_data(), chief.jobs.digits) in one process: the model every source must reach."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = run_pstrain(["train", "--standalone", "--run-dir", str(run_dir), "--steps", str(STEPS)])
    assert result.returncode == 0, result.output
    return run_dir


def assert_same_model(run_dir, reference, features) -> None:
    np.testing.assert_allclose(predictions(run_dir, features), predictions(reference, features), atol=1e-4, rtol=0)
    losses = [s["loss"] for s in metrics(run_dir)[0]]
    np.testing.assert_allclose(losses, [s["loss"] for s in metrics(reference)[0]], atol=1e-4, rtol=0)


def test_png_files_resumed_cluster_run_equals_the_array_job(tmp_path, data_env, array_reference):
    """digits_files (one PNG per example, decoded on the workers), stopped at a checkpoint and resumed:
    the same losses step by step and the same model as the array job in one process."""
    run_dir = tmp_path / "run"
    common = ["launch", "--job", "chief.jobs.digits_files", "--run-dir", str(run_dir), "--checkpoint-every", "15"]
    first = run_pstrain([*common, "--steps", "15"], env=data_env)
    assert first.returncode == 0, first.output
    second = run_pstrain([*common, "--steps", str(STEPS)], env=data_env)
    assert second.returncode == 0, second.output
    assert f"steps 15..{STEPS}" in second.output
    steps, done = metrics(run_dir)
    assert [s["step"] for s in steps] == list(range(STEPS)) and all(s["workers"] for s in steps)
    # Files are read ahead: most steps' examples were read while the previous step computed (a miss reads anew).
    assert sum(s["read_ahead"] for s in steps) > 0, [s["read_ahead"] for s in steps]
    assert_same_model(run_dir, array_reference, digits.eval_data()[0])
    assert len(list((Path(data_env["PSTRAIN_DATA_DIR"]) / "digits-png" / "train").glob("*.png"))) == len(digits.train_data()[1])
    assert done["eval_accuracy"] > 0.5
    # eval_dataset() (PNG files, read in batches) scores the same examples as the array job's eval_data().
    reference_done = metrics(array_reference)[1]
    assert done["eval_loss"] == pytest.approx(reference_done["eval_loss"], abs=1e-4)
    assert done["eval_accuracy"] == pytest.approx(reference_done["eval_accuracy"], abs=1e-9)
    assert_no_orphans(second)


def test_npy_fast_path_cluster_run_equals_the_array_job(tmp_path, data_env, array_reference):
    """train_arrays(): .npy files each worker reads once into memory, then gathers from."""
    run_dir = tmp_path / "run"
    args = ["launch", "--job", "tests.jobs.data_jobs:digits_npy", "--run-dir", str(run_dir), "--steps", str(STEPS)]
    result = run_pstrain(args, env=data_env)
    assert result.returncode == 0, result.output
    assert_same_model(run_dir, array_reference, digits.eval_data()[0])
    assert all("read_ahead" not in s for s in metrics(run_dir)[0]), "a gather from memory is not read ahead"
    assert not (run_dir / "data").exists(), "the job's own files are read; nothing is copied into the run dir"


def resumed_cluster_and_standalone(tmp_path, args: list[str], stop: int, steps: int, env=None):
    """The job on 2 workers and 2 ps, stopped at `stop` (a checkpoint) and resumed to `steps`; and in one
    process, uninterrupted. Returns (the cluster run dir, the standalone run dir)."""
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    cluster = ["launch", *args, "--workers", "2", "--ps", "2", "--run-dir", str(run_dir)]
    first = run_pstrain([*cluster, "--steps", str(stop)], env=env)
    assert first.returncode == 0, first.output
    second = run_pstrain([*cluster, "--steps", str(steps)], env=env)
    assert second.returncode == 0, second.output
    assert f"steps {stop}..{steps}" in second.output
    alone = run_pstrain(["train", "--standalone", *args, "--run-dir", str(reference), "--steps", str(steps)], env=env)
    assert alone.returncode == 0, alone.output
    records = metrics(run_dir)[0]
    assert [r["step"] for r in records] == list(range(steps))
    assert_both_workers_each_step(records, starts=2, first_steps=(0, stop))
    assert_no_orphans(second)
    return run_dir, reference


def test_tfrecord_stream_resumed_cluster_run_equals_standalone(tmp_path, data_env):
    """TFRecord files through list_files, interleave(TFRecordDataset), parse_single_example and a filter
    (no 9s: a stream whose size is known only at its end), 24 examples per slot: 1,283 examples make
    53 batches an epoch (11 examples dropped), so step 26 holds the last batch of epoch 0 and the first
    of epoch 1. Stopped at step 30, after the epoch length was learnt, and resumed at epoch 1 from it."""
    args, per_epoch = ["--job", "tests.jobs.data_jobs:digits_records_filtered", "--global-batch-size", "48"], 53
    run_dir, reference = resumed_cluster_and_standalone(tmp_path, args, 30, 40, data_env)
    assert json.loads((run_dir / "stream.json").read_text()) == {"slot_batch_size": 24, "batches_per_epoch": per_epoch}
    assert_same_model(run_dir, reference, digits.eval_data()[0])
    for run in (run_dir, reference):
        records = metrics(run)[0]
        assert [r["epoch"] for r in records] == [2 * step // per_epoch for step in range(40)]
        assert all(r["reread"] == 0 for r in records if "reread" in r), "each worker read its batches forward"
    assert metrics(run_dir)[1]["eval_loss"] == pytest.approx(metrics(reference)[1]["eval_loss"], abs=1e-4)


def test_text_features_resumed_cluster_run_equals_standalone(tmp_path):
    """chief.jobs.digits_text: a string column (train_data(), written as a fixed-width .npy the workers
    memory-map and decode) through a StringLookup, stopped and resumed on 2 workers and 2 ps: the
    standalone model, and a SavedModel that takes the strings."""
    from chief.jobs import digits_text

    run_dir, reference = resumed_cluster_and_standalone(tmp_path, ["--job", "chief.jobs.digits_text"], 15, 30)
    assert np.load(run_dir / "data" / "train-0.npy", mmap_mode="r").dtype == np.dtype("<U8")
    features = digits_text.eval_data()[0]
    assert_same_model(run_dir, reference, features)  # served from each run's SavedModel, fed strings
    accuracy = np.mean(predictions(run_dir, features).argmax(axis=1) == digits_text.eval_data()[1])
    # eval_accuracy is Keras's own accuracy metric, as model.evaluate reports it: a float32 mean
    assert accuracy > 0.3 and metrics(run_dir)[1]["eval_accuracy"] == pytest.approx(accuracy, abs=1e-6)


def test_backup_workers_with_png_files(tmp_path, data_env):
    run_dir, steps = tmp_path / "run", 12
    args = ["launch", "--job", "chief.jobs.digits_files", "--run-dir", str(run_dir), "--steps", str(steps)]
    args += ["--workers", "3", "--replicas-to-aggregate", "2", "--total-num-replicas", "3"]
    result = run_pstrain(args, env=data_env)
    assert result.returncode == 0, result.output
    records, done = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(steps)) and all(r["aggregated"] == 2 for r in records)
    # Each step's surplus slot is dropped late or skipped at the gate, as timing decides (test_local_cluster.py).
    assert done["stale_dropped_total"] <= steps
    assert_no_orphans(result)


def test_worker_killed_while_reading_ahead_png_files(tmp_path, data_env):
    """A worker killed mid-run: its closures run again elsewhere, the restarted worker builds a fresh
    read-ahead pipeline and rejoins, and the model is still the array job's (standalone, 1e-4)."""
    steps, run_dir, killed = 800, tmp_path / "run", []  # long enough for the restarted worker to rejoin
    args = ["launch", "--job", "chief.jobs.digits_files", "--run-dir", str(run_dir), "--steps", str(steps)]
    result = run_pstrain(args, env=data_env, signal_when=kill_task_when(run_dir, "worker", 1, 20, killed), send=None)
    assert killed and result.returncode == 0, result.output
    assert "pstrain: warning: " + lost_worker_warning("worker-1 exited (137)") in result.output
    records, _ = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(steps)) and all(r["aggregated"] == 2 for r in records)
    rejoined = [r for r in records[30:] if 1 in r["workers"]]
    assert rejoined and sum(r["read_ahead"] for r in rejoined) > 0, "the restarted worker reads ahead again"
    reference = tmp_path / "reference"
    alone = run_pstrain(["train", "--standalone", "--run-dir", str(reference), "--steps", str(steps)])
    assert alone.returncode == 0, alone.output
    assert_same_model(run_dir, reference, digits.eval_data()[0])
    assert_no_orphans(result)


FILES = 3000  # 3000 x 64 KiB = 188 MiB of examples
RSS_BUDGET = 40 * 2**20  # a worker may grow by this much while reading all of them (< a quarter of the set)


def test_one_file_per_example_keeps_worker_memory_flat_and_equals_standalone(tmp_path):
    """One epoch over a 188 MiB set of files with index_shuffle: each worker's RSS grows by less than
    a quarter of the set, and the cluster run equals the standalone run."""
    folder = tmp_path / "examples"
    write_example_files(folder, FILES)
    env = {"PSTRAIN_TEST_FILES": str(folder)}
    batch = 64
    steps = FILES // batch + 1  # every file read at least once
    common = ["--job", "tests.jobs.data_jobs:one_file_per_example", "--steps", str(steps), "--global-batch-size", str(batch)]
    common += ["--shuffle", "index_shuffle", "--checkpoint-every", "0"]
    common += ["--steps-per-execution", "4"]  # metrics lines during the epoch: the baseline is taken early, not at its end
    rss: dict[int, list[int]] = {0: [], 1: []}
    run_dir = tmp_path / "cluster"

    def sample() -> bool:
        from tests import helpers

        if step_lines(run_dir) < 2:  # baseline: the worker has built its source and read a batch
            return False
        for worker in rss:
            pid = task_pid(helpers.current_launcher, "worker", worker)
            try:
                rss[worker].append(psutil.Process(pid).memory_info().rss if pid else 0)
            except psutil.NoSuchProcess:
                pass
        return False

    result = run_pstrain(["launch", "--run-dir", str(run_dir), *common], env=env, signal_when=sample, send=None, poll_s=0.02)
    assert result.returncode == 0, result.output
    assert json.loads((run_dir / "cluster.json").read_text())["train"]["shuffle"] == "index_shuffle"
    data_bytes = FILES * FILE_INPUTS * 4
    for worker, samples in rss.items():
        samples = [s for s in samples if s]
        assert len(samples) >= 5, f"worker {worker}: too few RSS samples ({len(samples)})"
        growth = max(samples) - samples[0]
        print(f"worker {worker}: {len(samples)} RSS samples during the epoch, grew {growth / 2**20:.1f} MiB")
        assert growth < RSS_BUDGET, f"worker {worker} grew by {growth / 2**20:.0f} MiB reading {data_bytes / 2**20:.0f} MiB"
    reference = tmp_path / "standalone"
    alone = run_pstrain(["train", "--standalone", "--run-dir", str(reference), *common], env=env)
    assert alone.returncode == 0, alone.output
    probe = np.random.default_rng(1).standard_normal((4, FILE_INPUTS), dtype=np.float32)
    assert_same_model(run_dir, reference, probe)
    assert_no_orphans(result)


@pytest.mark.skipif(
    psutil.virtual_memory().available < 8 * 2**30 and os.environ.get("PSTRAIN_BIG_DATA") != "1",
    reason="2.2 GB of arrays needs about 7 GiB of free memory (PSTRAIN_BIG_DATA=1 runs it anyway)",
)
def test_big_array_set_trains(tmp_path):
    """A 2.2 GB train_data() set (more than a graph constant may hold) trains to completion: one
    worker, a tiny linear model, 3 steps (about 15 s; the chief holds the arrays, the worker loads
    them: about 7 GiB at the peak)."""
    run_dir = tmp_path / "run"
    args = ["launch", "--job", "tests.jobs.data_jobs:big_arrays", "--run-dir", str(run_dir), "--steps", "3"]
    args += ["--workers", "1", "--startup-timeout", "120"]
    result = run_pstrain(args, timeout=900)
    assert result.returncode == 0, result.output
    steps, done = metrics(run_dir)
    assert len(steps) == 3 and done is not None
    assert (run_dir / "data" / "train-0.npy").stat().st_size > 2**31, "more than a tensor proto may hold"
    shutil.rmtree(run_dir / "data")  # 2.2 GB of disk
