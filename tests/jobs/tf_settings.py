"""A job whose module fixes TensorFlow's threads and visible devices at import, as TF's guides and many
scripts do first thing (tests/system/test_job_tf_settings.py): on a cluster the chief has joined the
cluster (TF initialized) before it imports the job, where these calls raise RuntimeError."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tf_keras

tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(2)
tf.config.set_visible_devices(tf.config.list_physical_devices("CPU"))  # as it is: TF accepts it even when initialized
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)  # two logical CPUs


def model_fn() -> tf_keras.Model:
    return tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(8, activation="relu"), tf_keras.layers.Dense(1)])


loss_fn = "mse"


def optimizer_fn():
    return tf_keras.optimizers.Adam(1e-2)


def train_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    return x, (x.sum(axis=1, keepdims=True) / 4).astype(np.float32)
