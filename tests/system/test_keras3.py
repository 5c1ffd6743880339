"""Keras 3 jobs (`import keras`: tests/jobs/keras3.py, and keras.io's MNIST convnet as chief/jobs/digits_keras3.py)
on both engines: each cluster run ends bit for bit
equal to its standalone run (every checkpointed value: weights, BatchNormalization's statistics, the
optimizer's slots and iterations), evaluates and exports alike, and `pstrain evaluate` scores its
checkpoint; what pstrain cannot train exactly on Keras 3 is refused before the first step in one line."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from cluster.rundir import RunDir
from tests.helpers import assert_no_orphans, metrics, predictions, run_pstrain
from tests.system.test_bad_input import assert_one_line_error

pytestmark = pytest.mark.cluster

STEPS, BATCH = 6, 32
COMMON = ["--steps", str(STEPS), "--global-batch-size", str(BATCH)]
JOBS = {
    "compiled": ("tests.jobs.keras3:Compiled", ["--ps", "2"]),
    "plain": ("tests.jobs.keras3:Plain", []),
    "keras_io": ("chief.jobs.digits_keras3", []),  # keras.io's MNIST convnet, as written there
    "sharded": ("tests.jobs.keras3:Sharded", ["--ps", "2"]),  # a table split over 2 ps, Adam's slots too
}
GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
EVAL_EVERY = ["--eval-every", "3"]  # the evaluation during training too, on the live model


def train(run_dir: Path, job: str, *extra: str, cluster: bool = False):
    command = ["launch", *extra] if cluster else ["train", "--standalone"]
    result = run_pstrain([*command, "--job", job, "--run-dir", str(run_dir), *COMMON, *EVAL_EVERY])
    assert result.returncode == 0, result.output
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    base = tmp_path_factory.mktemp("keras3")
    out = {}
    for name, (job, extra) in JOBS.items():
        out[name] = {"standalone": base / f"{name}_standalone", "cluster": base / f"{name}_cluster"}
        train(out[name]["standalone"], job)
        assert_no_orphans(train(out[name]["cluster"], job, *extra, cluster=True))
    return out


def evals(run_dir: Path) -> list[dict]:
    """The --eval-every records of a run, without their time."""
    return [
        {k: v for k, v in record.items() if k != "time"}
        for record in RunDir(run_dir).read_metrics()
        if record.get("event") == "eval"
    ]


def checkpoint_values(run_dir: Path) -> dict[str, np.ndarray]:
    """Every value of the run's last checkpoint; its object graph without the variables' Keras names (numbered
    by how many models the process built: a cluster chief also builds its checkpoint mirror)."""
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(run_dir / "checkpoints")))
    values = {
        key: reader.get_tensor(key)
        for key in reader.get_variable_to_shape_map()
        if key != "save_counter/.ATTRIBUTES/VARIABLE_VALUE"
    }
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(values.pop(GRAPH))
    for node in graph.nodes:
        for attribute in node.attributes:
            attribute.ClearField("full_name")
    return {**values, GRAPH: str(graph)}


@pytest.mark.parametrize("name", list(JOBS))
def test_cluster_equals_standalone_bit_for_bit(runs, name):
    local, cluster = checkpoint_values(runs[name]["standalone"]), checkpoint_values(runs[name]["cluster"])
    assert sorted(local) == sorted(cluster)
    differ = [key for key in local if not np.array_equal(local[key], cluster[key])]
    assert not differ, differ
    assert local["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"] == STEPS  # the Keras 3 optimizer applied every step
    steps, _ = metrics(runs[name]["cluster"])
    assert steps[0]["loss"] != steps[-1]["loss"], "the weights moved"


def test_compiled_job_uses_compile_and_its_state(runs):
    steps, done = metrics(runs["compiled"]["cluster"])
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert "eval_accuracy" in done and "eval_loss" in done, done  # compile(metrics=["accuracy"]), named as Keras 3 names it
    _, local = metrics(runs["compiled"]["standalone"])
    assert {k: done[k] for k in ("eval_loss", "eval_accuracy")} == {k: local[k] for k in ("eval_loss", "eval_accuracy")}
    evaluated = {engine: evals(runs["compiled"][engine]) for engine in ("cluster", "standalone")}
    assert [e["step"] for e in evaluated["cluster"]] == [3, 6] and evaluated["cluster"] == evaluated["standalone"]
    values = checkpoint_values(runs["compiled"]["cluster"])
    moving = [v for k, v in values.items() if "moving_mean" in k]
    assert moving and not np.all(moving[0] == 0), "BatchNormalization's statistics were updated"
    # A Keras 3 checkpoint reaches the model's weights through the optimizer (the first path it finds).
    kernel = values["optimizer/_trainable_variables/1/.ATTRIBUTES/VARIABLE_VALUE"]  # the constrained Dense
    assert kernel.shape == (35, 16)
    assert np.all(np.sqrt((kernel**2).sum(axis=0)) <= 1.0 + 1e-6), "MaxNorm(1.0) applied (glorot columns start near 1.17)"
    log = (runs["compiled"]["cluster"] / "logs" / "chief-0.log").read_text()
    assert "row-sparse gradients (only touched rows move): table/embeddings" in log


def test_sharded_table_is_split_over_ps(runs):
    """The table (562 KiB) is split over both ps, its Adam slots with it, and checkpointed full-size."""
    log = (runs["sharded"]["cluster"] / "logs" / "chief-0.log").read_text()
    assert "split across ps: big_table/embeddings (2 shards)" in log, log
    assert "a Keras 3 variable is split over ps: the chief writes them from a full copy" in log, log
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(runs["sharded"]["cluster"] / "checkpoints")))
    shapes = reader.get_variable_to_shape_map()
    assert shapes["optimizer/_variables/2/.ATTRIBUTES/VARIABLE_VALUE"] == [3000, 48]  # the table's momentum, whole


def test_sharded_refused_where_not_elementwise(tmp_path):
    """Lamb scales each variable's update by its whole norm: refused on 2 ps, trained on one process."""
    run_dir = tmp_path / "lamb"
    job = ["--job", "tests.jobs.keras3:ShardedLamb", "--run-dir", str(run_dir), *COMMON]
    result = run_pstrain(["launch", "--ps", "2", *job], timeout=200)
    assert_one_line_error(
        result, "--job tests.jobs.keras3:ShardedLamb: optimizer_fn: a Keras 3 Lamb updates big_table/embeddings as a whole"
    )
    assert "use --ps 1" in result.output
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").glob("*.index"))
    assert_no_orphans(result)


def test_plan_says_the_refusal_before_measuring(tmp_path):
    """`pstrain plan` on the same job: one line naming the refusal on 2 ps, before any measured run."""
    result = run_pstrain(["plan", "--job", "tests.jobs.keras3:ShardedLamb", "--log", str(tmp_path / "runs.log")], timeout=200)
    assert_one_line_error(
        result, "pstrain plan: --job tests.jobs.keras3:ShardedLamb is refused on 2 ps or more (optimizer_fn: a Keras 3 Lamb"
    )
    assert "measuring" not in result.output and not (tmp_path / "runs.log").exists(), result.output
    assert_no_orphans(result)


def test_plain_job_metrics_and_schedule(runs):
    _, done = metrics(runs["plain"]["cluster"])
    _, local = metrics(runs["plain"]["standalone"])
    assert "eval_mean_absolute_error" in done, done  # metrics_fn's Keras 3 metric
    assert done["eval_mean_absolute_error"] == local["eval_mean_absolute_error"]
    steps, _ = metrics(runs["plain"]["standalone"])
    rates = [s.get("learning_rate") for s in steps]
    assert rates[0] == pytest.approx(0.05) and rates[-1] < rates[0], rates  # the Keras 3 schedule, read per step


@pytest.mark.parametrize("name", list(JOBS))
def test_export_and_evaluate(runs, name):
    module, _, attr = JOBS[name][0].partition(":")
    job = importlib.import_module(module)
    job = getattr(job, attr) if attr else job
    features = job.eval_data()[0]
    local, cluster = predictions(runs[name]["standalone"], features), predictions(runs[name]["cluster"], features)
    np.testing.assert_array_equal(local, cluster)
    result = run_pstrain(["evaluate", str(runs[name]["cluster"]), "--timeout", "30", "--poll", "0.5"], timeout=200)
    assert result.returncode == 0, result.output
    evaluated = json.loads((runs[name]["cluster"] / "eval.jsonl").read_text().splitlines()[-1])
    _, done = metrics(runs[name]["cluster"])
    assert evaluated["step"] == STEPS and evaluated["eval_loss"] == done["eval_loss"], (evaluated, done)


# Each refusal is tested in process too (tests/chief/test_keras3_jobs.py); here, on both engines, one of each kind.
REFUSED = {
    "MixedOptimizer": "--job tests.jobs.keras3:MixedOptimizer: model_fn() returns a Keras 3 Sequential model but "
    "optimizer_fn()'s optimizer is a tf_keras SGD",
    "HalfPrecision": "--job tests.jobs.keras3:HalfPrecision: Keras 3 layer 'half' computes in float16 (mixed_float16)",
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_in_one_line_on_both_engines(tmp_path, name):
    for command in (["train", "--standalone"], ["launch"]):
        run_dir = tmp_path / command[0]
        result = run_pstrain([*command, "--job", f"tests.jobs.keras3:{name}", "--run-dir", str(run_dir), *COMMON], timeout=200)
        assert_one_line_error(result, REFUSED[name])
        assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").glob("*.index"))
        assert_no_orphans(result)
