"""The guide-pattern matrix (issue 34): jobs written from TensorFlow's and Keras's own guides
(tests/jobs/guides.py), each run on both engines to the end: training, `--eval-every`, the final
evaluation, the export and `pstrain evaluate` beside the cluster run. Each case ends equal on both
engines (the same step losses, scores and exported predictions), and its scores are the ones tf_keras's
`model.evaluate` gives for the run's last checkpoint on the same data; a pattern pstrain cannot make
exact is refused by both engines, in one line, before the first step.

One cluster run per case, kept short (6 steps of 16 examples, tiny models); the standalone run and the
sidecar evaluator run beside it. Keras 3 (`import keras`) cases go in KERAS3_CASES below.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from chief.contract.job import load_job
from cluster.rundir import RunDir
from tests.helpers import PSTRAIN, ROOT, assert_no_orphans, metrics, predictions, run_pstrain
from tests.system.test_bad_input import assert_one_line_error
from worker.input.datasets import single_examples

pytestmark = pytest.mark.cluster

STEPS = 6
COMMON = ["--steps", str(STEPS), "--global-batch-size", "16", "--eval-every", "3", "--checkpoint-every", "3"]

CASES = [  # (case, job): every case trains on both engines and ends equal
    ("pss-tutorial-stream", "tests.jobs.guides:PssTutorial"),
    ("pss-tutorial-as-written-batched-and-repeated", "tests.jobs.guides:PssTutorialAsWritten"),
    ("pss-hashing-integer-lookup-by-position", "tests.jobs.guides:PssHashingByPosition"),
    ("pss-module-level-lookups-binary-accuracy", "tests.jobs.guide_module_tables"),
    ("built-in-methods-activity-losses", "tests.jobs.guides:BuiltInMethods"),
    ("preprocessing-in-the-model-one-hot-labels", "tests.jobs.guides:PreprocessingInModel"),
    ("preprocessing-in-the-dataset-one-hot-accuracy", "tests.jobs.guides:PreprocessingInDataset"),
    ("sparse-no-metrics", "tests.jobs.guides:SparseNoMetrics"),
]
KERAS3_CASES = [  # jobs written with `import keras` (tests/jobs/guides_keras3.py), the same checks
    ("keras3-built-in-methods-rmsprop-activity-losses", "tests.jobs.guides_keras3:BuiltInMethods"),
    ("keras3-string-lookup-in-the-dataset-binary-accuracy", "tests.jobs.guides_keras3:LookupInDataset"),
]

REFUSED = [  # (case, job, the one line both engines print)
    ("add-metric", "tests.jobs.guides:AddMetric", "model_fn: layer 'metric_logging_layer"),
    (
        "adapt-in-the-pipeline",
        "tests.jobs.guides:AdaptInDataset",
        "--job tests.jobs.guides:AdaptInDataset: train_dataset() adapts",
    ),
]


def eval_examples(job) -> tuple:
    """The job's eval set as one batch (the sets here are under 1,024 examples: the chief reads one batch)."""
    if job.eval_data:
        return tuple(job.eval_data()[:2])
    return tuple(single_examples(job.eval_dataset())[0].batch(1024).get_single_element()[:2])


def keras_scores(spec: str, run_dir: Path, reported: dict) -> dict[str, float]:
    """tf_keras's `model.evaluate` of the run's last checkpoint on the eval set, compiled with the job's
    loss and metrics, or (a job without metrics that pstrain gives an eval_accuracy) `metrics=["accuracy"]`."""
    job = load_job(spec)
    x, y = eval_examples(job)
    model = job.model_fn()
    model(x, training=False)
    tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(str(RunDir(run_dir).checkpoints))).expect_partial()
    metrics = job.metrics_fn() if job.metrics_fn else job.compiled_metrics()[0] if job.compiled_metrics else None
    if not metrics and "eval_accuracy" in reported:
        metrics = ["accuracy"]
    model.compile(loss=job.loss_fn, loss_weights=job.loss_weights, metrics=metrics)
    scores = model.evaluate(x, y, batch_size=1024, verbose=0, return_dict=True)
    return {f"eval_{k}": v for k, v in scores.items()}


def run_both(tmp_path: Path, spec: str):
    """The cluster run (with the sidecar evaluator following it) and the standalone run, side by side."""
    cluster, standalone = tmp_path / "cluster", tmp_path / "standalone"
    evaluator = subprocess.Popen(
        PSTRAIN + ["evaluate", str(cluster), "--timeout", "300", "--poll", "0.5"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ},
    )
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = [
                pool.submit(run_pstrain, [*command, "--job", spec, "--run-dir", str(run_dir), *COMMON], 400)
                for command, run_dir in ((["launch"], cluster), (["train", "--standalone"], standalone))
            ]
            results = [run.result() for run in runs]
        sidecar, _ = evaluator.communicate(timeout=120) if all(r.returncode == 0 for r in results) else ("", None)
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
            evaluator.wait()
    return cluster, standalone, results, sidecar


@pytest.mark.parametrize("spec", [spec for _, spec in CASES + KERAS3_CASES], ids=[c for c, _ in CASES + KERAS3_CASES])
def test_a_guide_pattern_trains_equal_on_both_engines(tmp_path, spec):
    cluster, standalone, results, sidecar = run_both(tmp_path, spec)
    for result in results:
        assert result.returncode == 0, result.output
        assert_no_orphans(result)
    (steps, done), (steps_local, done_local) = metrics(cluster), metrics(standalone)
    assert len(steps) == STEPS and all(s["aggregated"] == 2 for s in steps)
    assert [s["loss"] for s in steps] == [s["loss"] for s in steps_local]
    scores = {k: v for k, v in done.items() if k.startswith("eval_")}
    assert scores == {k: v for k, v in done_local.items() if k.startswith("eval_")}
    # --eval-every 3: the last evaluation is the final one's; the sidecar followed every checkpoint
    evaluations = [r for r in RunDir(cluster).read_metrics() if r.get("event") == "eval"]
    assert [r["step"] for r in evaluations] == [3, 6] and {k: evaluations[-1][k] for k in scores} == scores
    followed = [json.loads(line) for line in RunDir(cluster).evaluations.read_text().splitlines()]
    assert followed[-1]["step"] == STEPS and {k: followed[-1][k] for k in scores} == pytest.approx(scores, rel=1e-6), sidecar
    # the scores are model.evaluate's for the same model on the same data
    assert scores == pytest.approx(keras_scores(spec, cluster, scores), rel=1e-5)
    features = eval_examples(load_job(spec))[0]
    np.testing.assert_array_equal(predictions(cluster, features), predictions(standalone, features))


@pytest.mark.parametrize("spec, message", [(s, m) for _, s, m in REFUSED], ids=[c for c, _, _ in REFUSED])
def test_a_guide_pattern_pstrain_cannot_make_exact_is_refused_by_both_engines(tmp_path, spec, message):
    with ThreadPoolExecutor(2) as pool:  # side by side, as the cases above
        runs = [
            pool.submit(run_pstrain, [*command, "--job", spec, "--run-dir", str(tmp_path / command[0]), *COMMON], 300)
            for command in (["launch"], ["train", "--standalone"])
        ]
        results = [run.result() for run in runs]
    for result in results:
        assert_one_line_error(result, message)
        assert_no_orphans(result)
