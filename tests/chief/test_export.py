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


class TwoHeads(tf_keras.Model):
    """A subclassed model returning a tuple of outputs (Keras names them output_1, output_2)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = tf_keras.layers.Dense(3), tf_keras.layers.Dense(1)

    def call(self, x, training=False):
        return self.a(x), self.b(x)


def functional_two_heads() -> tf_keras.Model:
    """A functional model with a list of outputs: named by their layers."""
    x = tf_keras.Input((4,))
    return tf_keras.Model(x, [tf_keras.layers.Dense(3, name="kind")(x), tf_keras.layers.Dense(1, name="size")(x)])


@pytest.mark.pure
@pytest.mark.parametrize("make, names", [(TwoHeads, ["output_1", "output_2"]), (functional_two_heads, ["kind", "size"])])
def test_a_list_or_tuple_of_outputs_serves_one_output_per_name(tmp_path, make, names):
    model, x = make(), np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    expected = model(x)
    export_saved_model(model, x, tmp_path / "saved_model")
    served = tf.saved_model.load(str(tmp_path / "saved_model")).signatures["serving_default"](features=tf.constant(x))
    assert sorted(served) == names
    for name, value in zip(names, expected, strict=True):
        np.testing.assert_allclose(served[name].numpy(), value.numpy(), rtol=1e-6)


@pytest.mark.pure
def test_the_signature_takes_the_inputs_the_model_declares_not_the_data_shape(tmp_path):
    """A dict column of shape [N] fed to `Input(shape=(1,))` (Keras expands it): the export takes [None, 1]."""
    x = tf_keras.Input((1,), name="age")
    words = tf_keras.Input((), dtype="string", name="word")
    length = tf_keras.layers.Lambda(lambda w: tf.cast(tf.strings.length(w), tf.float32)[:, None])(words)
    model = tf_keras.Model({"age": x, "word": words}, tf_keras.layers.Dense(1)(tf_keras.layers.Concatenate()([x, length])))
    data = {"age": np.arange(4, dtype=np.float32), "word": np.array(["a", "bb", "ccc", "d"])}
    expected = model(data).numpy()
    export_saved_model(model, data, tmp_path / "saved_model")
    serve = tf.saved_model.load(str(tmp_path / "saved_model")).signatures["serving_default"]
    assert serve.structured_input_signature[1]["age"].shape.as_list() == [None, 1]
    assert serve.structured_input_signature[1]["word"].shape.as_list() == [None]
    served = serve(age=tf.constant(data["age"][:, None]), word=tf.constant(data["word"]))["predictions"]
    np.testing.assert_allclose(served.numpy(), expected, rtol=1e-6)
