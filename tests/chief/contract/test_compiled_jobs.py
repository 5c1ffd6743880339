"""A compiled model is a job: one step equals `model.fit`, a cluster run equals the standalone run,
and a job that gives a piece in a form pstrain does not take gets one line naming it."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from chief.contract.arrays import rows
from chief.contract.job import JobError, load_job
from tests.helpers import assert_no_orphans, metrics, run_pstrain
from tests.jobs import compiled
from tests.system.test_bad_input import assert_one_line_error
from worker.ps.clipping import apply_clipped
from worker.replica.replica import Replica, replica_step


@pytest.mark.pure
@pytest.mark.parametrize("name", ["Compiled", "CompiledNewStyle", "Uncompiled"])
def test_one_step_equals_model_fit_for_a_two_output_model(name):
    """Two slots' mean gradient (loss per output, loss weights, sample weights, an L2 regularizer,
    clipping) applied once = one step of Keras's fit on the same 16 examples; the same loss too."""
    job = load_job(f"tests.jobs.compiled:{name}")
    x, y, w = compiled.two_output_data(16)

    tf_keras.utils.set_random_seed(1)
    keras_model = compiled.Compiled.model_fn()
    if name == "CompiledNewStyle":
        keras_model.compile(
            optimizer=compiled.CompiledNewStyle.optimizer(), loss=compiled.LOSSES, loss_weights=compiled.LOSS_WEIGHTS
        )
    history = keras_model.fit(x, y, sample_weight=w, batch_size=16, epochs=1, shuffle=False, verbose=0)

    tf_keras.utils.set_random_seed(1)
    model, optimizer = job.model_fn(), job.optimizer_fn()
    replica = Replica(job, model, optimizer, (), seed=0, num_slots=2)
    losses, grads = [], []
    for k in range(2):
        loss, slot_grads, _ = replica_step(replica, rows((x, y, w), slice(8 * k, 8 * k + 8)), tf.constant(0, tf.int64), k)
        losses.append(float(loss))
        grads.append(slot_grads)
    apply_clipped(optimizer, [(a + b) / 2 for a, b in zip(*grads, strict=True)], model.trainable_variables)
    assert np.mean(losses) == pytest.approx(history.history["loss"][0], rel=1e-5)
    moved = 0.0
    for ours, theirs, before in zip(model.get_weights(), keras_model.get_weights(), job.model_fn().get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
        moved = max(moved, float(np.abs(theirs - before).max()))
    assert moved > 1e-3


@pytest.mark.pure
def test_each_build_gets_its_own_optimizer_and_metrics():
    job = load_job("tests.jobs.compiled:Compiled")
    first, second = job.optimizer_fn(), job.optimizer_fn()
    assert first is not second and type(first) is tf_keras.optimizers.legacy.SGD
    assert first.get_config() == second.get_config() and first.clipnorm == 0.5
    (a, _), (b, _) = job.compiled_metrics(), job.compiled_metrics()
    assert a["kind"] == b["kind"] == ["accuracy"]
    assert a["size"][0] is not b["size"][0] and a["size"][0].name == b["size"][0].name == "mae"


REFUSED = [
    ("NoLoss", "--job tests.jobs.compiled:NoLoss: missing loss_fn; define loss_fn in the job, or compile the model"),
    ("BadLossEntry", "--job tests.jobs.compiled:BadLossEntry: loss_fn: found int 3; give a function, a tf_keras.losses.Loss"),
    ("UnknownLossName", "--job tests.jobs.compiled:UnknownLossName: model_fn's compile(loss=...): unknown loss name 'msee'"),
    ("BadLossWeights", "--job tests.jobs.compiled:BadLossWeights: loss_weights: found str 'half'; give a number"),
    ("OptimizerObject", "--job tests.jobs.compiled:OptimizerObject: optimizer_fn: found a SGD object; define a function"),
    ("SharedOptimizer", "--job tests.jobs.compiled:SharedOptimizer: optimizer_fn() returns the same optimizer at each call"),
    ("CustomTrainStep", "--job tests.jobs.compiled:CustomTrainStep: model_fn()'s Penalized overrides train_step, which pstrain"),
    ("CustomComputeLoss", "--job tests.jobs.compiled:CustomComputeLoss: model_fn()'s PenalizedLoss overrides compute_loss,"),
]


@pytest.mark.pure
@pytest.mark.parametrize("name, message", REFUSED, ids=[name for name, _ in REFUSED])
def test_a_piece_in_a_form_pstrain_does_not_take_is_named(name, message):
    with pytest.raises(JobError) as raised:
        load_job(f"tests.jobs.compiled:{name}")
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)


@pytest.mark.cluster
def test_a_loss_for_an_output_that_does_not_exist_is_refused_in_one_line(tmp_path):
    result = run_pstrain(
        ["train", "--standalone", "--job", "tests.jobs.compiled:WrongOutputName", "--run-dir", str(tmp_path / "r")], timeout=120
    )
    assert_one_line_error(result, "loss_fn: no output named 'sise'; the model's outputs are ['kind', 'size']")


@pytest.mark.cluster
def test_a_model_with_its_own_train_step_is_refused_before_training(tmp_path):
    """pstrain runs its own step: a train_step of the job's would be skipped, a silently different model."""
    result = run_pstrain(
        ["train", "--standalone", "--job", "tests.jobs.compiled:CustomTrainStep", "--run-dir", str(tmp_path / "r")], timeout=120
    )
    job = "--job tests.jobs.compiled:CustomTrainStep"
    assert_one_line_error(result, f"{job}: model_fn()'s Penalized overrides train_step, which pstrain does not run")
    assert not (tmp_path / "r" / "metrics.jsonl").exists(), "refused before the first step"


def serve(run_dir, features) -> dict[str, np.ndarray]:
    signature = tf.saved_model.load(str(run_dir / "saved_model")).signatures["serving_default"]
    return {name: value.numpy() for name, value in signature(tf.constant(features)).items()}


@pytest.mark.cluster
def test_compiled_two_output_job_on_two_ps_resumed_equals_standalone(tmp_path):
    """chief.jobs.digits_compiled (compile: a loss per output, loss weights, metrics, Adam with
    global_clipnorm; a kernel split over both ps): 2 workers, 2 ps, stopped at step 10 and resumed
    to 20, ends with the model of the standalone run, served with both outputs."""
    from chief.jobs import digits_compiled

    common = ["--job", "chief.jobs.digits_compiled", "--global-batch-size", "64", "--checkpoint-every", "5"]
    cluster, standalone = tmp_path / "cluster", tmp_path / "standalone"
    for steps in ("10", "20"):
        result = run_pstrain(["launch", *common, "--ps", "2", "--workers", "2", "--steps", steps, "--run-dir", str(cluster)])
        assert result.returncode == 0, result.output
        assert_no_orphans(result)
    log = (cluster / "logs" / "chief-0.log").read_text()
    assert "resumed from" in log and "at step 10" in log and "(2 shards)" in log
    result = run_pstrain(["train", "--standalone", *common, "--steps", "20", "--run-dir", str(standalone)])
    assert result.returncode == 0, result.output
    features = digits_compiled.eval_data()[0]
    ours, reference = serve(cluster, features), serve(standalone, features)
    assert set(ours) == {"digit", "ink"}
    for name in ours:
        np.testing.assert_allclose(ours[name], reference[name], atol=1e-4, rtol=0)
    done, standalone_done = metrics(cluster)[1], metrics(standalone)[1]
    for key in ("eval_loss", "eval_digit_accuracy", "eval_ink_mae"):
        assert done[key] == pytest.approx(standalone_done[key], abs=1e-4)


@pytest.mark.pure
def test_evaluation_of_a_compiled_job_is_model_evaluate():
    """eval_loss and the per-output metrics, read in batches of 20, as Keras's evaluate (batches of 1024) reports them."""
    from chief.data.eval_set import EvalSet
    from chief.scores import evaluate

    job = load_job("tests.jobs.compiled:Compiled")
    x, y, _ = compiled.two_output_data(100, 2)
    model = job.model_fn()
    ours = evaluate(job, model, EvalSet.from_arrays((x, y), "eval_data()"), batch=20)
    theirs = model.evaluate(x, y, batch_size=1024, verbose=0, return_dict=True)
    assert set(ours) == {"eval_loss", "eval_kind_accuracy", "eval_size_mae"}
    for name, value in ours.items():
        assert value == pytest.approx(theirs[name.removeprefix("eval_")], rel=1e-5), name


@pytest.mark.pure
def test_a_loss_fn_written_as_a_factory_gives_its_loss():
    job = load_job("tests.jobs.guides:LossFactory")
    assert isinstance(job.loss_fn, tf_keras.losses.SparseCategoricalCrossentropy) and job.loss_name == "loss_fn()"
    assert load_job("tests.jobs.guides:SparseNoMetrics").loss_fn == "sparse_categorical_crossentropy"
