"""Training by epochs (chief/epochs.py): the plan as a pure function, the config's refusals, a stream's
length, and a real cluster run stopped mid-epoch that resumes to the standalone model."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import tensorflow as tf

from chief.epochs import Epochs, epochs_for, pass_length
from chief.jobs import digits
from cluster.config import ConfigError, TrainConfig, resolve
from tests.helpers import assert_no_orphans, metrics, predictions, run_pstrain, step_lines
from worker.input.streams import StreamSource


@pytest.mark.pure
def test_an_epoch_is_the_whole_steps_of_one_pass():
    train = TrainConfig(epochs=3, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    plan = epochs_for(train, 1437)
    assert plan == Epochs(3, 22) and plan.steps == 66  # 1437 // 64: the remainder opens the next epoch
    assert [plan.epoch_of(s) for s in (0, 21, 22, 65)] == [0, 0, 1, 2]
    assert [plan.ends_epoch(d) for d in (0, 21, 22, 44)] == [False, False, True, True]
    backups = TrainConfig(epochs=1, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=3)
    assert epochs_for(backups, 1437).steps_per_epoch == 1437 // 96  # a step reads the backup's slot too
    assert epochs_for(TrainConfig(), 1437) is None  # by steps


@pytest.mark.pure
def test_epoch_intervals_resolve_to_the_epoch_length():
    train = resolve({"train": {"epochs": 2, "eval_every": "epoch", "checkpoint_every": "epoch"}}).train
    assert (train.eval_every, train.checkpoint_every) == ("epoch", "epoch")
    resolved = epochs_for(train, 1000).resolve(train)
    assert (resolved.steps, resolved.eval_every, resolved.checkpoint_every) == (30, 15, 15)
    steps_every = resolve({"train": {"epochs": 2, "eval_every": 5}}).train
    assert epochs_for(steps_every, 1000).resolve(steps_every).eval_every == 5


@pytest.mark.pure
@pytest.mark.parametrize(
    "raw, overrides, says",
    [
        ({"train": {"epochs": 2}}, {"steps": 10}, "train.steps and train.epochs: give one of them"),
        ({"train": {"steps": 10, "epochs": 2}}, {}, "train.steps and train.epochs: give one of them"),
        ({"train": {"eval_every": "epoch"}}, {}, 'train.eval_every: "epoch" needs train.epochs'),
        ({"train": {"epochs": 1, "checkpoint_every": "often"}}, {}, 'train.checkpoint_every: expected a step count or "epoch"'),
        ({"train": {"epochs": -1}}, {}, "train.epochs: must be >= 0"),
    ],
)
def test_the_config_refuses_in_one_line(raw, overrides, says):
    with pytest.raises(ConfigError, match=says) as refused:
        resolve(raw, overrides)
    assert "\n" not in str(refused.value)


@pytest.mark.pure
def test_a_pass_shorter_than_a_step_or_of_unknown_length_is_refused():
    train = TrainConfig(epochs=1, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    with pytest.raises(ConfigError, match=r"train.epochs: one pass .* is 50 examples, fewer than one step reads \(64\)"):
        epochs_for(train, 50)
    with pytest.raises(ConfigError, match=r"not known before its first pass \(why\); declare it .*assert_cardinality"):
        epochs_for(train, None, "why")


@pytest.mark.pure
def test_a_streams_pass_is_its_whole_slot_batches(tmp_path):
    filtered = lambda: tf.data.Dataset.range(103).filter(lambda i: i % 1 == 0).map(lambda i: (i, i))  # noqa: E731
    declared = lambda: filtered().apply(tf.data.experimental.assert_cardinality(103))  # noqa: E731
    assert pass_length(StreamSource(declared, "train_dataset()", None, 4, 2)) == (100, "")  # 25 batches of 4
    length, why = pass_length(StreamSource(filtered, "train_dataset()", None, 4, 2))
    assert length is None and "unknown cardinality" in why
    length, why = pass_length(StreamSource(lambda: filtered().repeat(), "train_dataset()", None, 4, 2))
    assert length is None and "repeats without end" in why
    record = tmp_path / "stream.json"  # what a run by steps learnt: a resume by epochs reads it
    record.write_text(json.dumps({"slot_batch_size": 4, "batches_per_epoch": 25}))
    assert pass_length(StreamSource(filtered, "train_dataset()", record, 4, 2)) == (100, "")


@pytest.mark.cluster
def test_a_run_stopped_mid_epoch_resumes_to_the_standalone_model(tmp_path):
    """digits, 3 epochs of 22 steps, evaluated and checkpointed at each epoch's end, K = 4: SIGTERM in the
    second epoch; the same command resumes mid-epoch, and the model equals the uninterrupted standalone
    run's. Every step line carries its epoch, and the progress lines show it."""
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    by_epochs = ["--epochs", "3", "--eval-every", "epoch", "--checkpoint-every", "epoch", "--steps-per-execution", "4"]
    args = ["launch", "--run-dir", str(run_dir), *by_epochs]
    first = run_pstrain(args, signal_when=lambda: step_lines(run_dir) >= 30, send=signal.SIGTERM)  # in epoch 2
    stopped_at = len(metrics(run_dir)[0])
    assert first.returncode == 128 + signal.SIGTERM and 22 < stopped_at < 44, (stopped_at, first.output)
    assert_no_orphans(first)
    second = run_pstrain(args)
    assert second.returncode == 0, second.output
    assert f"steps {stopped_at}..66" in second.output and "3 epochs of 22 steps" in second.output, second.output
    records, done = metrics(run_dir)
    assert [(r["step"], r["epoch"]) for r in records] == [(s, s // 22) for s in range(66)] and done["steps"] == 66
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert [e["step"] for e in evals] == [22, 44, 66]
    assert {"ckpt-44.index", "ckpt-66.index"} <= {p.name for p in (run_dir / "checkpoints").iterdir()}
    standalone = run_pstrain(["train", "--standalone", "--run-dir", str(reference), *by_epochs])
    assert standalone.returncode == 0, standalone.output
    assert "epoch 1/3  step 1/66" in standalone.output and "epoch 3/3  step 66/66" in standalone.output, standalone.output
    features, _ = digits.eval_data()
    np.testing.assert_allclose(predictions(run_dir, features), predictions(reference, features), atol=1e-4, rtol=0)
    assert_no_orphans(second)
