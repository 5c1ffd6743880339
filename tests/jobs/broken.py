"""Jobs that fail on purpose, for the bad-input tests."""

import numpy as np
import tensorflow as tf
import tf_keras

from chief.jobs import digits


class Raises:
    """A job whose model_fn raises."""

    train_data = staticmethod(digits.train_data)
    loss_fn = staticmethod(digits.loss_fn)
    optimizer_fn = staticmethod(digits.optimizer_fn)

    @staticmethod
    def model_fn():
        raise ValueError("layer sizes must be positive")


class Diverges:
    """A job whose loss becomes NaN within a few steps."""

    model_fn = staticmethod(digits.model_fn)
    train_data = staticmethod(digits.train_data)

    @staticmethod
    def loss_fn(y_true, y_pred):
        return tf.reduce_mean(tf.math.log(tf.reduce_sum(y_pred, axis=1) * 0.0 - 1.0)) + digits.loss_fn(y_true, y_pred)

    @staticmethod
    def optimizer_fn():
        return tf_keras.optimizers.legacy.SGD(0.1)


class NoModel:
    """A job without model_fn."""

    train_data = staticmethod(lambda: (np.zeros((4, 2)), np.zeros(4)))


class WrongLossShape:
    """loss_fn reduces over the wrong axis: one value per class, not per example."""

    model_fn = staticmethod(digits.model_fn)
    train_data = staticmethod(digits.train_data)
    optimizer_fn = staticmethod(digits.optimizer_fn)

    @staticmethod
    def loss_fn(y_true, y_pred):
        # Labels come as [batch, 1] (Keras matches their rank to the output's, as fit does).
        return tf.reduce_mean(tf.one_hot(tf.reshape(y_true, [-1]), 10) - tf.nn.softmax(y_pred), axis=0)


class LabelsMismatch:
    """Labels given as a dict while the model has a single output."""

    model_fn = staticmethod(digits.model_fn)
    loss_fn = staticmethod(digits.loss_fn)
    optimizer_fn = staticmethod(digits.optimizer_fn)

    @staticmethod
    def train_data():
        x, y = digits.train_data()
        return x, {"digit": y, "parity": y % 2}


class NonFinite:
    """A model whose output is NaN (log of a negative number)."""

    train_data = staticmethod(digits.train_data)
    loss_fn = staticmethod(digits.loss_fn)
    optimizer_fn = staticmethod(digits.optimizer_fn)

    @staticmethod
    def model_fn():
        return tf_keras.Sequential(
            [tf_keras.Input((8, 8, 1)), tf_keras.layers.Flatten(), tf_keras.layers.Lambda(lambda x: tf.math.log(x - 2.0))]
        )


class Counter(tf_keras.layers.Layer):
    """Counts its calls with a raw op: a state change pstrain cannot capture."""

    def build(self, input_shape):
        self.calls = self.add_weight(name="calls", shape=(), initializer="zeros", trainable=False)

    def call(self, x):
        tf.raw_ops.AssignAddVariableOp(resource=self.calls.handle, value=tf.constant(1.0))
        return x


class Jitter(tf_keras.layers.Layer):
    """Adds noise with a stateful random op (not Keras's RandomGenerator)."""

    def call(self, x, training=None):
        return x + tf.random.uniform(tf.shape(x)) * 0.01 if training else x


def _with(layer_cls):
    def model_fn():
        return tf_keras.Sequential(
            [
                tf_keras.Input((8, 8, 1)),
                tf_keras.layers.Flatten(),
                layer_cls(name=f"my_{layer_cls.__name__.lower()}"),
                tf_keras.layers.Dense(10),
            ]
        )

    return staticmethod(model_fn)


class RawAssign:
    model_fn = _with(Counter)
    loss_fn = staticmethod(digits.loss_fn)
    optimizer_fn = staticmethod(digits.optimizer_fn)
    train_data = staticmethod(digits.train_data)


class StatefulRandom(RawAssign):
    model_fn = _with(Jitter)


class LossRaises:
    """A loss_fn that raises while it is traced (a bug in the job, not a shape problem)."""

    model_fn = staticmethod(digits.model_fn)
    train_data = staticmethod(digits.train_data)
    optimizer_fn = staticmethod(digits.optimizer_fn)

    @staticmethod
    def loss_fn(y_true, y_pred):
        raise ValueError("boom: this loss is not written yet")


class FrozenBias(tf_keras.layers.Dense):
    """A Dense layer asserting at run time that its bias never moved: true at step 0, false from step 1."""

    def call(self, x):
        moved = tf.reduce_max(tf.abs(self.bias))
        tf.debugging.assert_equal(moved, 0.0, message="the bias moved")
        return super().call(x)


class AssertsAtStep1:
    """A model whose tf.debugging assertion fails on the worker at step 1."""

    train_data = staticmethod(digits.train_data)
    loss_fn = staticmethod(digits.loss_fn)
    optimizer_fn = staticmethod(digits.optimizer_fn)

    @staticmethod
    def model_fn():
        return tf_keras.Sequential([tf_keras.Input((8, 8, 1)), tf_keras.layers.Flatten(), FrozenBias(10)])


class UnorderedRecords:
    """TFRecord files read through an unseeded shuffle: a different order in every build."""

    model_fn = staticmethod(digits.model_fn)
    loss_fn = staticmethod(digits.loss_fn)
    optimizer_fn = staticmethod(digits.optimizer_fn)

    @staticmethod
    def train_dataset():
        from chief.jobs import digits_records

        return digits_records.train_dataset().shuffle(512)  # no seed
