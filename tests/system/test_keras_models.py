"""Keras models as users write them, trained synchronously: each cluster run equals its standalone run (1e-4).

One `Mixed` job run (dict inputs, an adapted Normalization, BatchNorm CNN, Dropout, L2, a Loss object, sample weights, metrics,
--eval-every, a sidecar evaluator beside it) is shared by several focused tests, to keep CI short.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from chief.contract.arrays import rows
from chief.contract.job import Job
from chief.state.model_state import initial_weights
from cluster.rundir import RunDir
from tests.conftest import _free_port
from tests.helpers import PSTRAIN, ROOT, assert_no_orphans, metrics, predictions, run_pstrain
from tests.jobs import keras_models
from tests.system.test_bad_input import assert_one_line_error
from worker.replica.randomness import stateless_random

pytestmark = pytest.mark.cluster

STEPS, BATCH = 20, 32
COMMON = ["--steps", str(STEPS), "--global-batch-size", str(BATCH)]
MIXED = "tests.jobs.keras_models:Mixed"


def train(run_dir: Path, job: str, *extra: str, cluster: bool = False):
    command = ["launch"] if cluster else ["train", "--standalone"]
    result = run_pstrain([*command, "--job", job, "--run-dir", str(run_dir), *COMMON, *extra])
    assert result.returncode == 0, result.output
    return result


def restored(job_cls, run_dir: Path, sample) -> tf_keras.Model:
    """The job's model with the run's last checkpoint (including non-trainable state)."""
    try:
        model = job_cls.model_fn()
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")  # a job may set a global policy (Bf16 does)
    model(sample, training=False)
    tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(str(run_dir / "checkpoints"))).expect_partial()
    return model


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("mixed")
    runs = {name: base / name for name in ("cluster", "standalone", "rerun", "no_l2")}
    # The sidecar evaluator starts before the run exists and follows its checkpoints until the done line.
    evaluator = subprocess.Popen(
        PSTRAIN + ["evaluate", str(runs["cluster"]), "--timeout", "400", "--poll", "0.5"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ},
    )
    try:
        result = train(runs["cluster"], MIXED, "--eval-every", "10", "--checkpoint-every", "5", cluster=True)
        assert_no_orphans(result)
        out, _ = evaluator.communicate(timeout=120)
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
            evaluator.wait()
    assert evaluator.returncode == 0, out
    train(runs["standalone"], MIXED, "--eval-every", "10")
    train(runs["rerun"], MIXED)
    train(runs["no_l2"], "tests.jobs.keras_models:MixedNoL2")
    return runs


def eval_features():
    return keras_models.mixed_data(128, 1)[0]


def test_mixed_model_cluster_equals_standalone(mixed):
    """Dict inputs by name, random augmentation, GaussianNoise, BatchNorm, Dropout, L2, a Loss object and
    sample weights: the same model."""
    features = eval_features()
    np.testing.assert_allclose(
        predictions(mixed["cluster"], features), predictions(mixed["standalone"], features), atol=1e-4, rtol=0
    )
    cluster_steps, standalone_steps = metrics(mixed["cluster"])[0], metrics(mixed["standalone"])[0]
    assert all(s["aggregated"] == 2 for s in cluster_steps) and {w for s in cluster_steps for w in s["workers"]} == {0, 1}
    np.testing.assert_allclose([s["loss"] for s in cluster_steps], [s["loss"] for s in standalone_steps], atol=1e-4, rtol=0)


def test_batchnorm_moving_statistics_are_synchronous(mixed):
    sample = rows(eval_features(), slice(0, 1))
    cluster = restored(keras_models.Mixed, mixed["cluster"], sample)
    standalone = restored(keras_models.Mixed, mixed["standalone"], sample)
    position = [i for i, layer in enumerate(cluster.layers) if isinstance(layer, tf_keras.layers.BatchNormalization)][0]
    bn, bn_local = cluster.layers[position], standalone.layers[position]
    assert np.abs(bn.moving_mean.numpy()).max() > 1e-3, "the moving mean was updated"
    np.testing.assert_allclose(bn.moving_mean.numpy(), bn_local.moving_mean.numpy(), atol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), bn_local.moving_variance.numpy(), atol=1e-5)


def test_dropout_draws_depend_only_on_seed_step_and_slot(mixed):
    """A rerun is bit-identical; in one trace the same (step, slot) draws the same mask, another slot another."""
    assert [s["loss"] for s in metrics(mixed["standalone"])[0]] == [s["loss"] for s in metrics(mixed["rerun"])[0]]
    model = tf_keras.Sequential([tf_keras.Input((1000,)), tf_keras.layers.Dropout(0.5)])
    ones = tf.ones((1, 1000))

    def mask(step: int, slot: int):
        with stateless_random(model, 0, tf.constant(step, tf.int64), slot):
            return model(ones, training=True).numpy()

    assert np.array_equal(mask(3, 1), mask(3, 1))
    assert not np.array_equal(mask(3, 1), mask(3, 0)) and not np.array_equal(mask(3, 1), mask(4, 1))
    assert 400 < np.count_nonzero(mask(3, 1)) < 600


def test_l2_regularizer_is_added_once_per_step(mixed):
    """With the same initial weights and dropout draws, step 0's loss differs by exactly L2 * |kernel|^2."""
    with_l2, without = metrics(mixed["standalone"])[0][0]["loss"], metrics(mixed["no_l2"])[0][0]["loss"]
    job = keras_models.Mixed
    weights = initial_weights(
        Job("t", job.model_fn, job.loss_fn, job.optimizer_fn, job.train_data, None), 0, rows(eval_features(), slice(0, 1))
    )
    kernel = [w for w in weights if w.ndim == 2 and w.shape[1] == 16][0]  # the regularized Dense(16)
    assert with_l2 - without == pytest.approx(job.L2 * float(np.sum(kernel.astype(np.float64) ** 2)), rel=1e-4)
    features = eval_features()
    assert np.abs(predictions(mixed["standalone"], features) - predictions(mixed["no_l2"], features)).max() > 1e-3


def test_eval_every_k_steps_and_done_line_report_every_metric(mixed):
    lines = RunDir(mixed["cluster"]).read_metrics()
    evals = [r for r in lines if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [10, 20]
    done = metrics(mixed["cluster"])[1]
    for key in ("eval_loss", "eval_accuracy", "eval_top2"):
        assert key in done and key in evals[-1]
        assert evals[-1][key] == pytest.approx(done[key], abs=1e-6)
    standalone_done = metrics(mixed["standalone"])[1]
    for key in ("eval_loss", "eval_accuracy", "eval_top2"):
        assert done[key] == pytest.approx(standalone_done[key], abs=1e-4), key


def test_sidecar_evaluator_followed_every_checkpoint(mixed):
    records = [json.loads(line) for line in (mixed["cluster"] / "eval.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS and len(steps) >= 2, steps
    done = metrics(mixed["cluster"])[1]
    assert records[-1]["eval_loss"] == pytest.approx(done["eval_loss"], abs=1e-5)
    assert records[-1]["eval_accuracy"] == pytest.approx(done["eval_accuracy"], abs=1e-6)


@pytest.mark.parametrize("policy", ["Bf16", "Fp16"])
def test_mixed_precision_cluster_equals_standalone(tmp_path, policy):
    """mixed_bfloat16, and mixed_float16 with a LossScaleOptimizer: float32 variables, same model."""
    job = f"tests.jobs.keras_models:{policy}"
    train(tmp_path / "cluster", job, cluster=True)
    train(tmp_path / "standalone", job)
    features = keras_models.regression_data(64, 1)[0]
    np.testing.assert_allclose(
        predictions(tmp_path / "cluster", features), predictions(tmp_path / "standalone", features), atol=1e-4
    )
    model = restored(getattr(keras_models, policy), tmp_path / "cluster", features[:1])
    compute = {"Bf16": "bfloat16", "Fp16": "float16"}[policy]
    assert model.layers[0].compute_dtype == compute and all(v.dtype == tf.float32 for v in model.weights)


def test_backup_workers_with_batchnorm_apply_one_update_per_step(tmp_path):
    """Column 0 is constant: after k moving-average updates its moving variance is momentum ** k. One
    update per step, whatever the dropped backup replicas computed."""
    run_dir = tmp_path / "run"
    result = train(
        run_dir,
        "tests.jobs.keras_models:BackupBN",
        "--workers",
        "3",
        "--replicas-to-aggregate",
        "2",
        "--total-num-replicas",
        "3",
        cluster=True,
    )
    assert_no_orphans(result)
    records, done = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS)) and all(r["aggregated"] == 2 for r in records)
    # The surplus slot of a step is dropped (counted) when it pushes after the step was applied, or never
    # computed when its closure reaches the gate after that (timing decides which, so no exact count).
    assert done["stale_dropped_total"] <= STEPS
    bn = restored(keras_models.BackupBN, run_dir, keras_models.backup_data()[0][:1]).layers[0]
    momentum = keras_models.BackupBN.MOMENTUM
    assert bn.moving_variance.numpy()[0] == pytest.approx(momentum**STEPS, rel=1e-5)
    assert bn.moving_mean.numpy()[0] == pytest.approx(1 - momentum**STEPS, rel=1e-5)


REFUSALS = [
    ("WrongLossShape", "loss_fn returned a loss of shape [10] for a batch of 32"),
    ("LabelsMismatch", "loss_fn: the labels {'digit': [32], 'parity': [32]} do not match the model's outputs [32, 10]"),
    ("NonFinite", "model_fn: the model's output (shape [32, 64]) on the first batch is not finite"),
    ("RawAssign", "model_fn: layer 'my_counter' makes a variable write (AssignAddVariableOp)"),
    ("StatefulRandom", "model_fn: layer 'my_jitter' makes a stateful random op (RandomUniform)"),
]


@pytest.mark.parametrize("job, message", REFUSALS, ids=[job for job, _ in REFUSALS])
def test_contract_refusals_standalone(tmp_path, job, message):
    result = run_pstrain(
        ["train", "--standalone", "--job", f"tests.jobs.broken:{job}", "--run-dir", str(tmp_path / "r")], timeout=120
    )
    assert_one_line_error(result, message)


def test_contract_refusal_on_the_cluster(tmp_path):
    job, message = REFUSALS[0]
    result = run_pstrain(["launch", "--job", f"tests.jobs.broken:{job}", "--run-dir", str(tmp_path / "r")], timeout=180)
    assert_one_line_error(result, message)
    assert_no_orphans(result)


def test_a_resume_whose_adapted_layer_differs_is_refused(tmp_path):
    """model_fn adapts a Normalization at every start: on other data, the checkpoint's statistics belong to
    another model (checked before the restore writes them into the training model)."""
    job, run_dir = "tests.jobs.keras_models:AdaptedFromEnv", tmp_path / "r"
    common = ["train", "--standalone", "--job", job, "--run-dir", str(run_dir), "--checkpoint-every", "5"]
    first = run_pstrain([*common, "--steps", "5"])
    assert first.returncode == 0, first.output
    shifted = run_pstrain([*common, "--steps", "10"], env={"PSTRAIN_TEST_ADAPT_SHIFT": "1.5"}, timeout=120)
    assert_one_line_error(shifted, "model_fn: its adapted Normalization differs from the one this run started with")
    same = run_pstrain([*common, "--steps", "10"])
    assert same.returncode == 0 and "steps 5..10" in same.output, same.output


def test_tf_config_with_an_evaluator_task_trains_and_evaluates(tmp_path):
    """Kubeflow-style: every task's TF_CONFIG lists an `evaluator`; ps and workers run `pstrain server`, the
    evaluator task too (it follows the run's checkpoints). The chief does not wait for the evaluator."""
    from cluster.config import TrainConfig
    from cluster.rundir import describe, prepare

    run_dir = tmp_path / "run"
    chief, ps, w0, w1, evaluator = (f"127.0.0.1:{_free_port()}" for _ in range(5))
    cluster = {"chief": [chief], "ps": [ps], "worker": [w0, w1], "evaluator": [evaluator]}
    train_config = TrainConfig(
        job=MIXED,
        steps=10,
        global_batch_size=BATCH,
        replicas_to_aggregate=2,
        total_num_replicas=2,
        checkpoint_every=5,
        run_dir=str(run_dir),
    )
    prepare(RunDir(run_dir), describe("cluster", train_config, None), train_config)

    def start(task_type: str, index: int, command: list[str]) -> subprocess.Popen:
        tf_config = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, "environment": "cloud"})
        env = {**os.environ, "TF_CONFIG": tf_config, "TF_USE_LEGACY_KERAS": "1", "PSTRAIN_RUN_DIR": str(run_dir)}
        env.pop("PSTRAIN_CONTROL", None)
        log = open(run_dir / "logs" / f"{task_type}-{index}.log", "w")
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    servers = [
        start("ps", 0, PSTRAIN + ["server"]),
        start("worker", 0, PSTRAIN + ["server"]),
        start("worker", 1, PSTRAIN + ["server"]),
    ]
    evaluator_task = start("evaluator", 0, PSTRAIN + ["server"])
    chief_task = start("chief", 0, [*PSTRAIN[:2], "chief", "--run-dir", str(run_dir)])
    try:
        assert chief_task.wait(timeout=240) == 0, (run_dir / "logs" / "chief-0.log").read_text()[-3000:]
        assert evaluator_task.wait(timeout=120) == 0, (run_dir / "logs" / "evaluator-0.log").read_text()[-3000:]
    finally:
        for process in [chief_task, *servers, evaluator_task]:
            if process.poll() is None:
                process.kill() if process is chief_task else process.terminate()
                process.wait(timeout=30)
    steps, done = metrics(run_dir)
    assert len(steps) == 10 and all(s["aggregated"] == 2 for s in steps) and done is not None
    evaluated = [json.loads(line)["step"] for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evaluated[-1] == 10, evaluated


def test_evaluate_refuses_a_directory_that_is_not_a_run(tmp_path):
    result = run_pstrain(["evaluate", str(tmp_path), "--timeout", "1", "--poll", "0.2"], timeout=60)
    assert_one_line_error(result, f"evaluate: {tmp_path} is not a pstrain run directory (no cluster.json)")
