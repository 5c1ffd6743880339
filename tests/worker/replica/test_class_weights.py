"""`class_weight` on a job (worker/replica/class_weights.py) against Keras's own: the per-example weights of
fit's data adapter, one step of `fit(class_weight=...)`, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tf_keras.src.engine.data_adapter import _make_class_weight_map_fn

from chief.contract.arrays import rows
from chief.contract.job import Job, JobError, checked_class_weight, load_job
from worker.replica.class_weights import class_weighted
from worker.replica.replica import Replica, replica_step

CLASS_WEIGHT = {0: 0.5, 1: 2.0, 2: 1.25}


@pytest.mark.pure
@pytest.mark.parametrize("form", ["sparse", "column", "one-hot"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_weights_are_fits(form, weighted):
    rng = np.random.default_rng(0)
    classes = rng.integers(0, 3, 12)
    one_hot = np.eye(3, dtype=np.float32)[classes]
    labels = {"sparse": classes, "column": classes[:, None].astype(np.float32), "one-hot": one_hot}[form]
    data = (np.zeros((12, 2), np.float32), tf.constant(labels))
    if weighted:
        data += (tf.constant(rng.uniform(0.5, 2.0, 12).astype(np.float32)),)
    theirs = _make_class_weight_map_fn(CLASS_WEIGHT)(*data)[2]
    ours = class_weighted(checked_class_weight("t", CLASS_WEIGHT), data[1], data[2] if weighted else None)
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    assert not np.all(ours.numpy() == ours.numpy()[0]), "the weights differ by class"


@pytest.mark.pure
def test_one_step_equals_fit_with_class_weight_and_sample_weight():
    """Two slots' mean gradient with class and sample weights = one step of Keras's fit."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 3)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int32)
    w = rng.uniform(0.5, 2.0, size=16).astype(np.float32)
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def model_fn():
        tf_keras.utils.set_random_seed(1)
        return tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(3)])

    keras_model = model_fn()
    keras_model.compile(loss=loss, optimizer=tf_keras.optimizers.legacy.SGD(0.5))
    keras_model.fit(x, y, sample_weight=w, class_weight=CLASS_WEIGHT, batch_size=16, epochs=1, shuffle=False, verbose=0)

    model, optimizer = model_fn(), tf_keras.optimizers.legacy.SGD(0.5)
    job = Job("t", model_fn, loss, lambda: optimizer, lambda: (x, y, w), None, class_weight=CLASS_WEIGHT)
    replica = Replica(job, model, optimizer, (), seed=0, num_slots=2)
    grads = [replica_step(replica, rows((x, y, w), slice(8 * k, 8 * k + 8)), tf.constant(0, tf.int64), k)[1] for k in range(2)]
    optimizer.apply_gradients(zip([(a + b) / 2 for a, b in zip(*grads, strict=True)], model.trainable_variables, strict=True))
    unweighted = model_fn()
    for ours, theirs, before in zip(model.get_weights(), keras_model.get_weights(), unweighted.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
        assert not np.allclose(ours, before), "the step moved the weights"


@pytest.mark.pure
@pytest.mark.parametrize(
    "value, message",
    [
        ({1: 2.0, 2: 1.0}, r"class_weight needs the labels 0 to 1 as keys \(as fit's class_weight\), found \[1, 2\]"),
        ([1.0, 2.0], r"class_weight must be a dict \{label: weight\}"),
        ({0: "heavy"}, r"class_weight must map integer labels to numbers"),
    ],
)
def test_a_class_weight_fit_would_refuse_is_refused_in_one_line(value, message):
    with pytest.raises(JobError, match=message):
        checked_class_weight("jobs.x", value)


@pytest.mark.pure
def test_class_weight_with_two_outputs_is_refused_as_fit_refuses_it(tmp_path):
    from chief.data.train_source import train_source
    from chief.step.local import LocalEngine
    from cluster.config import TrainConfig
    from cluster.rundir import RunDir

    job = load_job("tests.jobs.matrix:class_weighted_two_outputs")
    train = TrainConfig(job=job.spec, steps=1, global_batch_size=16, replicas_to_aggregate=2, total_num_replicas=2)
    source = train_source(job, RunDir(tmp_path), train)
    with pytest.raises(JobError, match=r"^class_weight: only for a model with one output, as in fit \(labels \{"):
        LocalEngine(job, train, source, tf.nest.map_structure(np.asarray, source.first(1)[0]))
