"""A Keras 3 job (`import keras`) is read, stepped and applied as Keras 3's own `fit` would: one pstrain
step (two slots' mean gradient, applied once) equals one step of `model.fit`; random layers draw per
(seed, step, slot) without writing their generator's state; a job mixing Keras 3 and tf_keras objects,
and a Keras 3 feature pstrain cannot make exact, are refused in one line. In process (no cluster)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from chief.contract.arrays import rows
from chief.contract.framework import trainable_of
from chief.contract.job import JobError, load_job
from chief.state.model_state import create_optimizer_slots
from tests.jobs import keras3
from worker.ps.clipping import apply_clipped
from worker.replica.randomness import stateless_random
from worker.replica.replica import Replica, replica_step

pytestmark = pytest.mark.pure


def test_one_step_equals_keras3_fit():
    """Sample weights, an L2 regularizer, a MaxNorm constraint, clipnorm and SGD with momentum: the
    mean of two 8-example slots applied once = Keras 3's fit on the same 16 examples, loss too."""
    job = load_job("tests.jobs.keras3:Fit")
    assert job.framework == "keras3" and job.loss_name == "model_fn's compile(loss=...)"
    x, y, w = keras3.regression_data(16, 0)
    keras.utils.set_random_seed(1)
    theirs = keras3.Fit.model_fn()
    before = [v.numpy() for v in theirs.weights]
    history = theirs.fit(x, y, sample_weight=w, batch_size=16, epochs=1, shuffle=False, verbose=0)

    keras.utils.set_random_seed(1)
    model, optimizer = job.model_fn(), job.optimizer_fn()
    assert type(optimizer) is keras.optimizers.SGD and optimizer is not job.optimizer_fn()
    create_optimizer_slots(optimizer, model.trainable_variables)
    replica = Replica(job, model, optimizer, (), seed=0, num_slots=2)
    losses, grads = [], []
    for k in range(2):
        loss, slot_grads, _ = replica_step(replica, rows((x, y, w), slice(8 * k, 8 * k + 8)), tf.constant(0, tf.int64), k)
        losses.append(float(loss))
        grads.append(slot_grads)
    apply_clipped(optimizer, [(a + b) / 2 for a, b in zip(*grads, strict=True)], trainable_of(model))
    assert np.mean(losses) == pytest.approx(history.history["loss"][0], rel=1e-5)
    assert int(optimizer.iterations) == 1
    for ours, fitted, start in zip(model.weights, theirs.weights, before, strict=True):
        np.testing.assert_allclose(ours.numpy(), fitted.numpy(), atol=1e-6)
        assert not np.array_equal(ours.numpy(), start), "the step moved every weight"


def test_keras3_dropout_draws_per_step_and_slot_without_writing_its_state():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dropout(0.5)])
    state = model.layers[0].seed_generator.state
    start, x = state.numpy().copy(), tf.ones([4, 64])

    def masks(step: int, slot: int) -> np.ndarray:
        with stateless_random(model, 7, tf.constant(step, tf.int64), slot):
            return tf.function(lambda x: model(x, training=True))(x).numpy()

    first = masks(3, 0)
    assert 0 < np.count_nonzero(first) < first.size  # dropout acted
    np.testing.assert_array_equal(first, masks(3, 0))  # a re-run closure draws the same
    assert not np.array_equal(first, masks(3, 1)) and not np.array_equal(first, masks(4, 0))
    np.testing.assert_array_equal(state.numpy(), start)
    assert "next" not in vars(model.layers[0].seed_generator)  # restored after the block


def test_compiled_names_are_resolved_and_metrics_fresh():
    job = load_job("tests.jobs.keras3:Compiled")
    (first, _), (second, _) = job.compiled_metrics(), job.compiled_metrics()
    assert first == second == ["accuracy"]
    assert type(job.optimizer_fn()) is keras.optimizers.Adam


REFUSED = [
    ("MixedOptimizer", "model_fn() returns a Keras 3 Sequential model but optimizer_fn()'s optimizer is a tf_keras SGD"),
    ("MixedLoss", "model_fn() returns a Keras 3 Sequential model but loss_fn is a tf_keras MeanSquaredError"),
    ("MixedMetrics", "model_fn() returns a Keras 3 Sequential model but metrics_fn()'s metrics is a tf_keras MeanAbsoluteError"),
    ("HalfPrecision", "Keras 3 layer 'half' computes in float16 (mixed_float16)"),
    ("Accumulating", "optimizer_fn: a Keras 3 optimizer's gradient_accumulation_steps=2 is not supported"),
    ("WeightedMeanLoss", "loss_fn: a Keras 3 MeanSquaredError with reduction='mean_with_sample_weight' is not supported"),
]


@pytest.mark.parametrize("name, message", REFUSED)
def test_refused_in_one_line(name, message):
    with pytest.raises(JobError) as raised:
        load_job(f"tests.jobs.keras3:{name}")
    text = str(raised.value)
    assert text.startswith(f"--job tests.jobs.keras3:{name}: {message}") and "\n" not in text, text


OPTIMIZERS = ["Adadelta", "Adafactor", "Adagrad", "Adam", "Adamax", "AdamW", "Ftrl", "Lamb", "Lion", "Nadam", "RMSprop", "SGD"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_keras3_optimizer_applies_a_mean_without_a_static_shape_as_it_applies_one_with(name):
    """On a cluster the ps reads the step's mean gradients from its accumulators, which give no static
    shape; Keras 3's ops read the shape while tracing (RMSprop failed: `as_list() is not defined on an
    unknown TensorShape`). `apply_gradients` gives each mean its variable's shape: three steps traced
    without shapes equal three traced with them, bit for bit."""
    from chief.contract.framework import apply_gradients, tf_variable

    def stepper(shapes):
        kernel = keras.Variable(np.linspace(-1, 1, 12, dtype="float32").reshape(3, 4), name="kernel")
        bias = keras.Variable(np.full(4, 0.5, "float32"), name="bias")
        optimizer = getattr(keras.optimizers, name)(learning_rate=0.05)
        create_optimizer_slots(optimizer, [kernel, bias])
        signature = [tf.TensorSpec(shape, tf.float32) for shape in shapes]
        step = tf.function(lambda k, b: apply_gradients(optimizer, [k, b], [tf_variable(kernel), tf_variable(bias)]))
        return step.get_concrete_function(*signature), [kernel, bias]

    known, known_vars = stepper([(3, 4), (4,)])
    unknown, unknown_vars = stepper([None, None])
    for s in range(3):
        grads = [tf.fill((3, 4), 0.1 * (s + 1)), tf.linspace(0.0, 1.0, 4) * (s - 1)]
        known(*grads)
        unknown(*grads)
    for mine, theirs in zip(unknown_vars, known_vars, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
