"""The replica's loss reduction against Keras's own `fit` (pure: no cluster, no processes)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from chief.contract.arrays import rows
from chief.contract.job import Job
from worker.replica.replica import Replica, replica_step

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    "loss",
    [
        tf_keras.losses.mean_squared_error,
        tf_keras.losses.MeanSquaredError(),
        tf_keras.losses.MeanSquaredError(reduction=tf_keras.losses.Reduction.SUM),
    ],
    ids=["per-example-function", "loss-object", "loss-object-sum"],
)
def test_loss_reduction_matches_keras_fit(loss):
    """Two slots' mean gradient (with sample weights and an L2 regularizer) = one step of Keras's fit."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, size=16).astype(np.float32)

    def model_fn():
        tf_keras.utils.set_random_seed(1)
        return tf_keras.Sequential(
            [tf_keras.Input((3,)), tf_keras.layers.Dense(2, kernel_regularizer=tf_keras.regularizers.l2(0.1))]
        )

    keras_model = model_fn()
    keras_model.compile(loss=loss, optimizer=tf_keras.optimizers.legacy.SGD(0.1))
    keras_model.fit(x, y, sample_weight=w, batch_size=16, epochs=1, shuffle=False, verbose=0)

    model, optimizer = model_fn(), tf_keras.optimizers.legacy.SGD(0.1)
    job = Job("t", model_fn, loss, lambda: optimizer, lambda: (x, y, w), None)
    replica = Replica(job, model, optimizer, (), seed=0, num_slots=2)
    grads = [replica_step(replica, rows((x, y, w), slice(8 * k, 8 * k + 8)), tf.constant(0, tf.int64), k)[1] for k in range(2)]
    optimizer.apply_gradients(zip([(a + b) / 2 for a, b in zip(*grads, strict=True)], model.trainable_variables, strict=True))
    for ours, theirs in zip(model.get_weights(), keras_model.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
