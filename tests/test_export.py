"""The SavedModel export: what serves is the signature, for any model a job can train."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from chief.export import export_saved_model


class Branching(tf_keras.Model):
    """A subclassed model as users write them: a Python `if` on a tensor in `call`."""

    def __init__(self):
        super().__init__()
        self.dense = tf_keras.layers.Dense(2)

    def call(self, x, training=False):
        if tf.reduce_mean(x) > 0.5:
            return self.dense(x) * 2.0
        return self.dense(x)


@pytest.mark.pure
def test_a_model_that_branches_in_python_exports_and_serves_its_predictions(tmp_path):
    model = Branching()
    low, high = np.full((3, 4), 0.1, np.float32), np.full((3, 4), 0.9, np.float32)
    model(low)  # built
    export_saved_model(model, low, tmp_path / "saved_model")
    serve = tf.saved_model.load(str(tmp_path / "saved_model")).signatures["serving_default"]
    for x in (low, high):  # both branches, as the model computes them
        np.testing.assert_array_equal(serve(features=tf.constant(x))["predictions"].numpy(), model(x).numpy())
    assert not (tmp_path / "saved_model.tmp").exists()
