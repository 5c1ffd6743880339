"""A job's callbacks_fn() (chief/callbacks.py): the hooks' order and logs, what is refused, and real
runs: LR schedules and EarlyStopping on a cluster equal to standalone, stop_training, CSVLogger."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from chief.callbacks import FitCallbacks, FitModel, check_monitored, job_callbacks
from chief.contract.job import JobError, load_job
from chief.jobs import digits
from tests.helpers import assert_no_orphans, metrics, predictions, run_pstrain

BY_EPOCH = ["--eval-every", "epoch", "--steps-per-execution", "4"]


class Seen(tf_keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_begin(self, epoch, logs=None):
        self.seen.append(("epoch_begin", epoch))

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(("batch_end", batch, logs["loss"]))
        if batch == 1 and self.seen[0] == ("epoch_begin", 1):
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(("epoch_end", epoch, logs))


@pytest.mark.pure
def test_a_resume_mid_epoch_keeps_the_checkpoints_rate_and_an_epoch_edge_applies_the_schedule():
    """The rate in a checkpoint taken mid-epoch was set by that epoch's on_epoch_begin; applying a
    schedule that scales the current rate again on resume would train another model."""
    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(2,))])
    halve = tf_keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)
    for first_step, expected in ((5, 0.05), (4, 0.025)):  # mid epoch 1 (resumed), then at epoch 1's start
        optimizer = tf_keras.optimizers.legacy.SGD(0.1)
        optimizer.learning_rate = tf.Variable(0.05)  # as restored: epoch 1 began at 0.1 * 0.5
        hooks = FitCallbacks([halve], FitModel(model, optimizer), steps_per_epoch=4, total_steps=12)
        hooks.begin(first_step)
        assert float(optimizer.learning_rate.numpy()) == pytest.approx(expected), first_step


@pytest.mark.pure
def test_hooks_run_per_step_after_the_block_and_epoch_hooks_at_its_edges():
    seen = Seen()
    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(2,))])
    hooks = FitCallbacks([seen], FitModel(model, tf_keras.optimizers.legacy.SGD(0.1)), steps_per_epoch=3, total_steps=6)
    hooks.begin(0)
    assert hooks.cut(0, 64) == 3 and hooks.cut(1, 64) == 2 and hooks.cut(3, 2) == 2  # blocks end at epoch edges
    assert not hooks.after_block(0, [4.0], None)
    assert not hooks.after_block(1, [2.0, 0.0], {"eval_loss": 0.5, "eval_accuracy": 0.75})
    assert seen.seen == [
        ("epoch_begin", 0),
        ("batch_end", 0, 4.0),
        ("batch_end", 1, 3.0),  # the epoch's running mean, as fit's
        ("batch_end", 2, 2.0),
        ("epoch_end", 0, {"loss": 2.0, "val_loss": 0.5, "val_accuracy": 0.75}),
        ("epoch_begin", 1),
    ]
    seen.seen = [("epoch_begin", 1)]
    assert hooks.after_block(3, [1.0, 1.0], None)  # stop_training, set in batch 1: the block's end stops the run
    assert seen.seen[-1] == ("batch_end", 1, 1.0)


@pytest.mark.pure
def test_what_pstrain_does_instead_is_said_and_what_it_never_calls_is_refused():
    said = []
    kept = job_callbacks(load_job("tests.jobs.callbacks:schedules"), said.append)
    assert [type(c).__name__ for c in kept] == [
        "LearningRateScheduler",
        "ReduceLROnPlateau",
        "CSVLogger",
        "TerminateOnNaN",
        "Hooks",
    ]
    assert [line.split(":")[1].strip() for line in said] == ["note", "note"]
    assert said[0].startswith("pstrain: note: ModelCheckpoint is not run: pstrain checkpoints the whole training state")
    assert "TensorBoard is not run: pstrain writes TensorBoard events" in said[1]
    with pytest.raises(JobError, match=r"callbacks_fn\(\): OnTest overrides on_test_batch_end, which pstrain never calls"):
        job_callbacks(load_job("tests.jobs.callbacks:tests_eval"), said.append)
    early = job_callbacks(load_job("tests.jobs.callbacks:early"), said.append)
    check_monitored("j", early, steps_per_epoch=22, eval_every=22)  # evaluated at every epoch's end
    check_monitored("j", early, steps_per_epoch=22, eval_every=11)
    for every in (0, 5):  # val_loss would never be there: EarlyStopping would only warn, never stop
        with pytest.raises(JobError, match=r"EarlyStopping monitors val_loss, but no evaluation runs at each epoch's end"):
            check_monitored("j", early, steps_per_epoch=22, eval_every=every)


def train(tmp_path, name: str, job: str, *args: str, launch: bool = False):
    run_dir = tmp_path / name
    out = tmp_path / f"{name}-files"
    out.mkdir()
    command = ["launch"] if launch else ["train", "--standalone"]
    result = run_pstrain(
        [*command, "--job", f"tests.jobs.callbacks:{job}", "--run-dir", str(run_dir), *args],
        env={"PSTRAIN_CALLBACKS_DIR": str(out)},
    )
    return run_dir, out, result


@pytest.mark.cluster
def test_learning_rate_callbacks_set_the_rate_the_ps_applies_as_standalone(tmp_path):
    """LearningRateScheduler and ReduceLROnPlateau over 3 epochs on a cluster: the rates the ps applied
    (metrics.jsonl), the CSVLogger's file and the model equal the standalone run's."""
    runs = {}
    for name, launch in (("cluster", True), ("standalone", False)):
        run_dir, out, result = train(tmp_path, name, "schedules", "--epochs", "3", *BY_EPOCH, launch=launch)
        assert result.returncode == 0, result.output
        runs[name] = run_dir, out, result
    rates = [[r["learning_rate"] for r in metrics(run_dir)[0]] for run_dir, _, _ in runs.values()]
    assert rates[0] == rates[1] and [rates[0][s] for s in (0, 22, 44)] == pytest.approx([1e-3, 5e-4, 2e-4]), rates[0]
    logs = [list(csv.DictReader(open(out / "log.csv"))) for _, out, _ in runs.values()]
    assert logs[0] == logs[1] and [row["epoch"] for row in logs[0]] == ["0", "1", "2"], logs
    assert "pstrain: note: ModelCheckpoint is not run" in runs["standalone"][2].output
    hooks = [json.loads(line) for line in open(runs["cluster"][1] / "hooks.jsonl")]
    assert [h[1] for h in hooks if h[0] == "batch_end"] == [b for _ in range(3) for b in range(22)]
    features, _ = digits.eval_data()
    np.testing.assert_array_equal(predictions(runs["cluster"][0], features), predictions(runs["standalone"][0], features))
    assert_no_orphans(runs["cluster"][2])


@pytest.mark.cluster
def test_early_stopping_restores_the_best_weights_into_the_export_and_the_last_checkpoint(tmp_path):
    """EarlyStopping(val_loss, mode max, patience 1, restore_best_weights) on a cluster: the run ends after
    epoch 2 (step 44) and holds epoch 1's weights: those of a standalone run of one epoch."""
    run_dir, _, result = train(tmp_path, "cluster", "early", "--epochs", "5", *BY_EPOCH, launch=True)
    assert result.returncode == 0, result.output
    assert metrics(run_dir)[1]["steps"] == 44 and len(metrics(run_dir)[0]) == 44
    one_epoch, _, reference = train(tmp_path, "one-epoch", "early", "--epochs", "1", *BY_EPOCH)
    assert reference.returncode == 0, reference.output
    features, _ = digits.eval_data()
    np.testing.assert_array_equal(predictions(run_dir, features), predictions(one_epoch, features))
    last, best = (tf.train.load_checkpoint(str(d / "checkpoints" / f"ckpt-{s}")) for d, s in ((run_dir, 44), (one_epoch, 22)))
    kernels = [
        name
        for name, _ in tf.train.list_variables(str(one_epoch / "checkpoints" / "ckpt-22"))
        if name.startswith("model/") and "kernel/.ATTRIBUTES" in name
    ]
    assert kernels and all(np.array_equal(last.get_tensor(k), best.get_tensor(k)) for k in kernels)


@pytest.mark.cluster
def test_stop_training_ends_the_run_at_the_blocks_end_with_a_checkpoint_and_a_per_batch_rate_is_refused(tmp_path):
    run_dir, out, result = train(tmp_path, "stops", "stops", "--epochs", "3", *BY_EPOCH)
    assert result.returncode == 0, result.output
    steps = metrics(run_dir)[1]["steps"]
    assert 22 + 9 <= steps <= 22 + 12 and (run_dir / "checkpoints" / f"ckpt-{steps}.index").exists(), steps
    assert json.loads(open(out / "hooks.jsonl").read().splitlines()[-1]) == ["train_end"]
    _, _, refused = train(tmp_path, "per-batch", "per_batch", "--epochs", "1", *BY_EPOCH)
    assert refused.returncode != 0 and "a batch hook changed the learning rate at step 0" in refused.output, refused.output
    assert "Traceback" not in refused.output


@pytest.mark.cluster
def test_terminate_on_nan_ends_a_run_that_skips_non_finite_steps(tmp_path):
    """With --on-nonfinite skip a non-finite step is withheld and the run would go on; TerminateOnNaN sees
    the first non-finite loss in the batch logs (the epoch's running mean, as fit's) and ends the run at
    that block's end (K = 4), with a checkpoint of finite weights. It watches the loss only: the steps
    before, whose gradients were not finite, go on (pstrain's default, stop, would end at the first)."""
    run_dir, _, result = train(tmp_path, "nan", "nan", "--epochs", "1", "--on-nonfinite", "skip", *BY_EPOCH)
    assert result.returncode == 0, result.output
    records, done = metrics(run_dir)
    skipped = [r["step"] for r in records if r.get("skipped")]  # a NaN pixel: NaN gradients, then an infinite loss
    first_bad_loss = next(r["step"] for r in records if not np.isfinite(r["loss"]))
    assert skipped and first_bad_loss < done["steps"] == len(records) <= first_bad_loss + 4 < 22, (skipped, done)
    assert "Invalid loss, terminating training" in result.output and "a callback set stop_training" in result.output
    assert (run_dir / "checkpoints" / f"ckpt-{done['steps']}.index").exists() and np.isfinite(done["eval_loss"])
