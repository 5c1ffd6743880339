"""A wide-and-deep click model, small enough for long runs: the chaos soak (tests/soak.py) and the
README's bit-exactness measurement (Faults, "Exact for long runs").

It has what made long runs drift in issue 19: a user table sharded over 2 ps (20,000 x 8 float32, 625 KiB:
chief/sharding.py), a Dense *with* a bias right before BatchNormalization (a parameter whose true
gradient is zero, so only rounding moves it), Dropout, and Adagrad (sparse: touched rows only). The
data is the recommender's synthetic click log (chief/jobs/recommender.py), 2,048 examples.
"""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from chief.jobs.recommender import FEATURES, Recommender

DATA = Recommender(users=20_000, items=2_000, dim=8, examples=2_048, eval_examples=512)


def model_fn() -> tf_keras.Model:
    inputs = {name: tf_keras.Input(shape=(), dtype="int32", name=name) for name in ("user", "item", *FEATURES)}
    user = tf_keras.layers.Embedding(DATA.users, DATA.dim, name="user_embedding")(inputs["user"])
    item = tf_keras.layers.Embedding(DATA.items, DATA.dim, name="item_embedding")(inputs["item"])
    features = [tf_keras.layers.Embedding(n, 4, name=f"{name}_embedding")(inputs[name]) for name, n in FEATURES.items()]
    wide = tf_keras.layers.Add()(
        [tf_keras.layers.Embedding(n, 2, name=f"{name}_wide")(inputs[name]) for name, n in FEATURES.items()]
    )
    deep = tf_keras.layers.Concatenate()([user, item, user * item, *features])
    deep = tf_keras.layers.Dense(32, name="deep")(deep)  # with a bias, before BatchNorm: its gradient is rounding
    deep = tf_keras.layers.BatchNormalization(momentum=0.9)(deep)
    deep = tf_keras.layers.ReLU()(deep)
    deep = tf_keras.layers.Dropout(0.2)(deep)
    return tf_keras.Model(inputs, tf_keras.layers.Add()([wide, tf_keras.layers.Dense(2)(deep)]))


def loss_fn(y_true, y_pred):
    return tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True))


def optimizer_fn():
    return tf_keras.optimizers.legacy.Adagrad(learning_rate=0.1)


def train_data():
    return DATA.train_data()


def eval_data():
    return DATA.eval_data()
