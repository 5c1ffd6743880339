"""The chief's local copy of the training state (chief/state/checkpoints.py), which evaluation and export
read: filled from the state or restored from a checkpoint, it computes what the state computes, layers
that derive tensors from their variables (an adapted Normalization) and weights that are no variables
(an adapted lookup layer's vocabulary) included."""

from __future__ import annotations

import numpy as np
import pytest
import tf_keras

from chief.contract.job import load_job
from chief.state.mirror import MirrorCheckpoints
from chief.state.model_state import build_state, finalize_layers

pytestmark = pytest.mark.pure

FEATURES = {"x": np.array([[1.0, 2.0, 3.0], [4.0, 0.0, -2.0]], np.float32), "word": np.array([["b"], ["zz"]])}
SAMPLE = {name: value[:1] for name, value in FEATURES.items()}


class Normalized:
    """A Normalization and a StringLookup adapted when the model is built: the first keeps its mean and
    variance as tensors, the second lists its vocabulary among the model's weights."""

    @staticmethod
    def model_fn() -> tf_keras.Model:
        inputs = {"x": tf_keras.Input((3,), name="x"), "word": tf_keras.Input((1,), dtype="string", name="word")}
        norm = tf_keras.layers.Normalization(name="norm")
        norm.adapt(np.array([[0.0, 0.0, 0.0], [2.0, 4.0, 6.0]], np.float32))  # mean 1, 2, 3; variance 1, 4, 9
        lookup = tf_keras.layers.StringLookup(output_mode="one_hot")
        lookup.adapt(np.array(["a", "b", "b", "c"]))
        joined = tf_keras.layers.Concatenate()([norm(inputs["x"]), lookup(inputs["word"])])
        return tf_keras.Model(inputs, tf_keras.layers.Dense(1, kernel_initializer="ones")(joined))

    loss_fn = "mse"

    @staticmethod
    def optimizer_fn():
        return tf_keras.optimizers.legacy.SGD(0.1)

    @staticmethod
    def train_data():
        return FEATURES, np.zeros((2, 1), np.float32)


def state_with_statistics(mean: list[float], variance: list[float]):
    """The training state (built as a standalone run builds it), its Normalization's variables then
    set to other values, as a trained or resumed state may hold them."""
    job = load_job("tests.chief.state.test_checkpoint_mirror:Normalized")
    state = build_state(job, seed=0, sample=SAMPLE)
    norm = state.model.get_layer("norm")
    norm.adapt_mean.assign(mean)
    norm.adapt_variance.assign(variance)
    finalize_layers(state.model)
    return job, state


def test_the_copy_computes_what_the_state_computes_after_a_sync_and_a_restore(tmp_path):
    job, live = state_with_statistics([10.0, 20.0, 30.0], [4.0, 4.0, 4.0])
    expected = live.model(FEATURES).numpy()
    # The sum of (x - mean) / 2 with the new mean, plus one for a word's one-hot (the unknown "zz" included).
    np.testing.assert_allclose(expected, [[-26.0], [-28.0]], rtol=1e-5)
    copy = MirrorCheckpoints(live, job, SAMPLE, tmp_path)
    np.testing.assert_allclose(copy.model()(FEATURES).numpy(), expected, rtol=1e-6)  # filled from the state
    copy.save(1)

    _, other = state_with_statistics([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    restored = MirrorCheckpoints(other, job, SAMPLE, tmp_path)
    assert restored.restore_latest() == 0  # the saved global step
    np.testing.assert_allclose(restored.model()(FEATURES).numpy(), expected, rtol=1e-6)  # restored from checkpoint 1
