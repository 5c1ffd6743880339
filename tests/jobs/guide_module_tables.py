"""TF's ParameterServerStrategy tutorial with its lookup layers created once, at module level (as a
script written from the tutorial has them), used in `train_dataset()`'s map."""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from tests.jobs.guides import FEATURES, LABELS, pss_examples, pss_model

feature_lookup = tf_keras.layers.StringLookup(vocabulary=FEATURES, mask_token=None)
label_lookup = tf_keras.layers.StringLookup(vocabulary=LABELS, num_oov_indices=0, mask_token=None)


def train_dataset():
    raw = tf.data.Dataset.from_tensor_slices(pss_examples(200, 0))
    return raw.map(lambda x: ({"features": feature_lookup(x["features"])}, label_lookup(x["label"])))


def model_fn():
    return pss_model(len(FEATURES) + 1)


loss_fn = tf_keras.losses.BinaryCrossentropy()


def optimizer_fn():
    return tf_keras.optimizers.legacy.RMSprop(learning_rate=0.1)
