"""TF's ParameterServerStrategy tutorial with its lookup layers created once, at module level (as a
script written from the tutorial has them), used in `train_dataset()`'s map; compiled with
`metrics=["accuracy"]` (Keras's binary accuracy for the one sigmoid unit)."""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from tests.jobs.guides import FEATURES, LABELS, pss_examples, pss_model

feature_lookup = tf_keras.layers.StringLookup(vocabulary=FEATURES, mask_token=None)
label_lookup = tf_keras.layers.StringLookup(vocabulary=LABELS, num_oov_indices=0, mask_token=None)


def train_dataset():
    raw = tf.data.Dataset.from_tensor_slices(pss_examples(200, 0))
    return raw.map(lambda x: ({"features": feature_lookup(x["features"])}, label_lookup(x["label"])))


def eval_dataset():
    raw = tf.data.Dataset.from_tensor_slices(pss_examples(64, 1))
    return raw.map(lambda x: ({"features": feature_lookup(x["features"])}, label_lookup(x["label"])))


def model_fn():
    model = pss_model(len(FEATURES) + 1)
    model.compile(optimizer=tf_keras.optimizers.legacy.RMSprop(0.1), loss="binary_crossentropy", metrics=["accuracy"])
    return model
