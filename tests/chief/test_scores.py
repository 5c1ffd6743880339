"""The chief's evaluation (chief/scores.py) equals tf_keras's `model.evaluate` on the same data and
batches: a model's own losses (`add_loss` in `call()`, `activity_regularizer`, weight regularizers)
enter per evaluated batch, and the default accuracy is Keras's "accuracy" for the output, or none."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from chief.contract.job import Job
from chief.data.eval_set import EvalSet
from chief.scores import evaluate

pytestmark = pytest.mark.pure


class SumOfSquares(tf_keras.layers.Layer):
    """A layer adding a batch-size-dependent loss in call(), as the Keras guide's ActivityRegularization layer."""

    def call(self, inputs):
        self.add_loss(1e-2 * tf.reduce_sum(tf.square(inputs)))
        return inputs


def activity_model(units: int) -> tf_keras.Model:
    tf_keras.utils.set_random_seed(5)
    inputs = tf_keras.Input((6,))
    x = tf_keras.layers.Dense(8, activation="relu", activity_regularizer=tf_keras.regularizers.L2(0.05))(inputs)
    x = SumOfSquares()(x)
    x = tf_keras.layers.Dense(units, kernel_regularizer=tf_keras.regularizers.L2(0.01))(x)
    return tf_keras.Model(inputs, x)


def data(n: int, labels: str):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = {"int": rng.integers(0, 2, n), "float": rng.standard_normal((n, 1)).astype(np.float32)}[labels]
    return x, y


def job(loss, metrics_fn=None) -> Job:
    return Job("t", lambda: None, loss, lambda: None, lambda: None, None, metrics_fn=metrics_fn)


@pytest.mark.parametrize("batch", [4, 1024], ids=["uneven-batches", "one-batch"])
def test_activity_losses_count_per_batch_as_model_evaluate_counts_them(batch):
    model, (x, y) = activity_model(3), data(10, "int")
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours = evaluate(job(loss), model, EvalSet.from_arrays((x, y), "x"), batch=batch)
    model.compile(loss=loss)
    theirs = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
    without = float(loss(y, model(x)))  # the losses are not nothing: they change the figure
    assert ours["eval_loss"] == pytest.approx(theirs["loss"], rel=1e-5) and abs(theirs["loss"] - without) > 1e-2


@pytest.mark.parametrize(
    "units, loss",
    [(1, tf_keras.losses.BinaryCrossentropy()), (3, tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))],
    ids=["one-unit-binary", "sparse-categorical"],
)
def test_the_default_accuracy_is_keras_accuracy_for_the_output(units, loss):
    model, (x, y) = activity_model(units), data(50, "int")
    if units == 1:
        model = tf_keras.Model(model.inputs, tf_keras.layers.Activation("sigmoid")(model.outputs[0]))
    ours = evaluate(job(loss), model, EvalSet.from_arrays((x, y), "x"), batch=16)
    model.compile(loss=loss, metrics=["accuracy"])
    theirs = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert ours == pytest.approx({"eval_loss": theirs["loss"], "eval_accuracy": theirs["accuracy"]}, rel=1e-5)
    if units == 1:  # not the argmax over one column (always class 0)
        assert ours["eval_accuracy"] != pytest.approx(float(np.mean(y == 0)))


def test_no_accuracy_where_the_labels_are_no_classes():
    model, (x, y) = activity_model(1), data(20, "float")
    ours = evaluate(job("mse"), model, EvalSet.from_arrays((x, y), "x"), batch=8)
    model.compile(loss="mse")
    assert ours == pytest.approx({"eval_loss": model.evaluate(x, y, batch_size=8, verbose=0)}, rel=1e-5)


def test_a_job_with_metrics_gets_only_its_metrics():
    model, (x, y) = activity_model(1), data(20, "int")
    ours = evaluate(job("mse", lambda: [tf_keras.metrics.AUC(name="auc")]), model, EvalSet.from_arrays((x, y), "x"))
    assert sorted(ours) == ["eval_auc", "eval_loss"]
