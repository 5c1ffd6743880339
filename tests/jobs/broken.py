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
