"""What train.dense = "allreduce" refuses before the first step: each in one line naming the field and the fix."""

from __future__ import annotations

import dataclasses

import pytest
import tensorflow as tf
import tf_keras

from chief.contract.job import load_job
from chief.state.model_state import build_state
from chief.step.hybrid import collectives_lost, mixed_policy, refusal
from cluster.config import TrainConfig
from worker.replica.gradients import sparse_variables
from worker.replica.replica import Replica

pytestmark = pytest.mark.pure

TRAIN = TrainConfig(
    job="tests.jobs.hybrid:adam", global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2, dense="allreduce"
)


def replica(job_name: str = "tests.jobs.hybrid:adam") -> tuple:
    """(the job, its Replica as an engine builds it: the model, optimizer and row-sparse variables)."""
    job = load_job(job_name)
    features = {name: column[:2] for name, column in job.train_data()[0].items()}
    state = build_state(job, 0, features)
    return job, Replica(job, state.model, state.optimizer, (), 0, 2, tuple(sparse_variables(state.model, features)))


@pytest.fixture(scope="module")
def adam():
    return replica()


def test_the_small_exact_path_is_taken(adam):
    job, r = adam
    assert refusal(job, TRAIN, r, workers=2) is None


@pytest.mark.parametrize("name", ["legacy", "legacy_sgd", "lazy_adam"])
def test_legacy_optimizers_are_taken(name):
    job, r = replica(f"tests.jobs.hybrid:{name}")
    assert refusal(job, TRAIN, r, workers=2) is None


@pytest.mark.parametrize(
    ("change", "workers", "says"),
    [
        ({"total_num_replicas": 3}, 2, "backup workers"),
        ({}, 3, "one slot per worker: set train.replicas_to_aggregate = 3"),
        ({"on_nonfinite": "skip"}, 2, 'train.on_nonfinite = "stop"'),
    ],
    ids=["backup-workers", "slots-not-workers", "skip"],
)
def test_settings_it_cannot_keep_exact_are_refused(adam, change, workers, says):
    job, r = adam
    why = refusal(job, dataclasses.replace(TRAIN, **change), r, workers)
    assert why is not None and says in why and 'train.dense = "ps"' in why and "\n" not in why


@pytest.mark.parametrize(("name", "says"), [("clipped", "clipping"), ("loss_scaled", "loss-scaled"), ("nadam", "Nadam")])
def test_optimizers_it_cannot_replicate_are_refused(name, says):
    job, r = replica(f"tests.jobs.hybrid:{name}")
    why = refusal(job, TRAIN, r, workers=2)
    assert why is not None and says in why and 'train.dense = "ps"' in why


def test_forward_pass_state_and_a_model_without_dense_variables_are_refused(adam):
    job, r = adam
    why = refusal(job, TRAIN, dataclasses.replace(r, state_variables=(tf.Variable(0.0),)), workers=2)
    assert why is not None and "BatchNormalization" in why
    tables_only = dataclasses.replace(r, sparse=tuple(True for _ in r.sparse))
    why = refusal(job, TRAIN, tables_only, workers=2)
    assert why is not None and "no dense trainable variable" in why


@pytest.mark.parametrize(
    "message",
    [
        "assertion failed: [train.dense = allreduce: a re-run closure found its worker\\'s dense copies past its step]",
        "Collective ops is aborted by: RecvBuf expects a different device incarnation: 1 vs. 2. Your worker job ...",
        "Collective has timed out during execution.",
    ],
    ids=["copies-past", "incarnation", "timed-out"],
)
def test_lost_collectives_are_told_apart_from_other_errors(message):
    """The chief exits 75 on these (the launcher restarts every worker, then the chief), on nothing else."""
    why = collectives_lost(tf.errors.FailedPreconditionError(None, None, message))
    assert why is not None and "\n" not in why
    assert collectives_lost(tf.errors.InvalidArgumentError(None, None, "shapes differ")) is None


def test_a_mixed_precision_policy_is_named_for_its_refusal():
    """The copies are plain float32 tensors, which Keras would not cast to bfloat16 as it casts variables."""
    layers = [tf_keras.Input((3,)), tf_keras.layers.Dense(4, dtype="mixed_bfloat16"), tf_keras.layers.Dense(1)]
    mixed = tf_keras.Sequential(layers)
    assert mixed_policy(mixed) == "mixed_bfloat16"
    assert mixed_policy(tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(1)])) is None
