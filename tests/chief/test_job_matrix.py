"""The job matrix: every data form under both engines, with and without sample weights, with one output
and two, compiled and not (jobs in tests/jobs/matrix.py). Each case ends with the cluster's model equal
to the standalone one, bit for bit.

Pruning (docs/testing.md): the data form decides only how a slot's (features, labels[, weights]) are
read, and the other three factors only how the loss is made from them, so the forms are crossed with
the loss factors pairwise, not fully: each form runs two complementary cases (every factor at both
levels), and the four complementary pairs are spread over the six forms, so every pair of levels of
any two factors is run at least once (12 cases, not 48). Every case carries a text column. One more
case adds fit's `class_weight` to weighted examples (worker/replica/class_weights.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from chief.contract.framework import variables_of
from chief.contract.job import load_job
from chief.data.train_source import train_source
from chief.step.dispatch import ClusterEngine
from chief.step.local import LocalEngine
from cluster.config import TrainConfig
from cluster.rundir import RunDir
from tests.chief.step.test_dispatch import full_weights
from tests.jobs.matrix import FORMS, case_name

# (weighted, outputs, compiled) and its complement: four pairs, each setting of two factors in some pair.
PAIRS = [
    ((True, 2, True), (False, 1, False)),
    ((False, 2, True), (True, 1, False)),
    ((True, 1, True), (False, 2, False)),
    ((False, 1, True), (True, 2, False)),
]
CASES = [case_name(form, *levels) for i, form in enumerate(FORMS) for levels in PAIRS[i % len(PAIRS)]]
STEPS = 3


def engines_on(resolver, spec: str, run_dir, steps: int = STEPS, **config):
    """Both engines on the job `spec`, `steps` steps each (the cluster's in one block), as the trainer
    builds them: its source under `run_dir`, one example's features as the sample."""
    job = load_job(spec)
    train = TrainConfig(job=spec, steps=steps, global_batch_size=16, replicas_to_aggregate=2, total_num_replicas=2, **config)
    source = train_source(job, RunDir(run_dir), train)
    sample = tf.nest.map_structure(np.asarray, source.first(1)[0])
    cluster = ClusterEngine(job, train, source, sample, resolver=resolver)
    cluster.prepare(0)
    cluster_results = cluster.run(0, steps)
    cluster.close()
    local = LocalEngine(job, train, train_source(job, RunDir(run_dir), train), sample)
    local.prepare(0)
    return cluster, local, list(zip(cluster_results, local.run(0, steps), strict=True))


def assert_equal_models(cluster, local, results) -> None:
    assert [c.loss for c, _ in results] == [s.loss for _, s in results]
    reference, variables = [v.numpy() for v in variables_of(local.state.model.weights)], variables_of(local.state.model.weights)
    for got, want, variable in zip(full_weights(cluster, reference), reference, variables, strict=True):
        assert np.array_equal(got, want), f"{variable.name}: differs by up to {np.abs(got - want).max():g}"


@pytest.mark.inprocess
@pytest.mark.parametrize("case", [*CASES, "class_weighted"])
def test_each_form_trains_alike_on_both_engines(in_process_cluster, case, tmp_path, monkeypatch):
    monkeypatch.setenv("PSTRAIN_MATRIX_DIR", str(tmp_path / "files"))
    cluster, local, results = engines_on(in_process_cluster, f"tests.jobs.matrix:{case}", tmp_path)
    assert len(results) == STEPS and all(c.applied and s.applied for c, s in results)
    assert_equal_models(cluster, local, results)


@pytest.mark.pure
def test_sample_weights_apply_to_a_batch_of_unknown_static_size():
    """A slot's batch may come without a static size (the cluster's read-ahead batches did): the weights
    are laid over the loss by its dynamic size. Before, `tf.reshape(weights, [None])` failed to build."""
    from worker.replica.losses import reduce_slot

    values, weights = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), tf.constant([0.5, 1.0, 2.0])

    @tf.function(input_signature=[tf.TensorSpec([None, 2]), tf.TensorSpec([None])], autograph=False)
    def unknown(v, w):
        return reduce_slot(v, "sum_over_batch_size", w, v.shape[0], 2, "loss_fn")

    known = reduce_slot(values, "sum_over_batch_size", weights, 3, 2, "loss_fn")
    assert float(unknown(values, weights)) == float(known) == pytest.approx((0.5 * 3 + 1 * 7 + 2 * 11) / 6)


@pytest.mark.inprocess
def test_examples_the_step_cannot_be_built_from_are_refused_by_both_engines_in_one_line(in_process_cluster, tmp_path):
    """Two weights per example for one loss value per example: not a raw TensorFlow error, but one
    line naming the job's data function and the shapes, the same from both engines."""
    from cluster.errors import UserCodeError

    lines = []
    for engine in (LocalEngine, ClusterEngine):
        job = load_job("tests.jobs.matrix:two_weights_per_example")
        train = TrainConfig(job=job.spec, steps=1, global_batch_size=16, replicas_to_aggregate=2, total_num_replicas=2)
        source = train_source(job, RunDir(tmp_path), train)
        sample = tf.nest.map_structure(np.asarray, source.first(1)[0])
        extra = {"resolver": in_process_cluster} if engine is ClusterEngine else {}
        with pytest.raises(UserCodeError) as refused:
            engine(job, train, source, sample, **extra)
        lines.append(str(refused.value))
    assert lines[0] == lines[1]
    assert "\n" not in lines[0] and "http" not in lines[0], lines[0]
    assert lines[0] == (
        "train_dataset(): pstrain could not build a training step from its examples "
        "(features {'x': [8, 3], 'word': [8]}, labels [8], sample weights [8, 2]): ValueError: Cannot reshape a "
        "tensor with 16 elements to shape [8] (8 elements); check that the examples' shapes and dtypes fit the model and its loss"
    )


@pytest.mark.cluster
def test_launch_trains_weighted_examples_as_standalone_and_refuses_what_standalone_refuses(tmp_path):
    """Real processes: a dataset read by position with sample weights and two outputs (the job that
    crashed `pstrain launch` and trained standalone) ends with the standalone model; weights it cannot
    lay over the loss are refused by both in the same one line, without a traceback."""
    from tests.helpers import assert_no_orphans, run_pstrain
    from tests.jobs.matrix import examples

    def served(run_dir) -> dict:
        serve = tf.saved_model.load(str(run_dir / "saved_model")).signatures["serving_default"]
        return {k: v.numpy() for k, v in serve(**{k: tf.constant(v) for k, v in examples(8, seed=1)[0].items()}).items()}

    common = ["--global-batch-size", "16", "--steps", "4", "--replicas-to-aggregate", "2"]
    env = {"PSTRAIN_MATRIX_DIR": str(tmp_path / "files")}
    lines = {}
    for job in ("position_w_2_p", "two_weights_per_example"):
        for how in (["launch", "--ps", "1", "--workers", "2"], ["train", "--standalone"]):
            run_dir = tmp_path / job / how[0]
            result = run_pstrain([*how, "--job", f"tests.jobs.matrix:{job}", *common, "--run-dir", str(run_dir)], env=env)
            assert_no_orphans(result)
            assert (result.returncode == 0) == (job == "position_w_2_p"), result.output
            assert "Traceback" not in result.output and "http" not in result.output, result.output
            lines[job, how[0]] = [
                line.split("; traceback in")[0] for line in result.output.splitlines() if line.startswith("pstrain: error:")
            ]
    ours, reference = served(tmp_path / "position_w_2_p" / "launch"), served(tmp_path / "position_w_2_p" / "train")
    assert set(ours) == {"kind", "size"}
    for name in ours:
        np.testing.assert_array_equal(ours[name], reference[name])
    refused = lines["two_weights_per_example", "launch"]
    assert refused == lines["two_weights_per_example", "train"] and len(refused) == 1, lines
    assert refused[0].startswith("pstrain: error: train_dataset(): pstrain could not build a training step"), refused
