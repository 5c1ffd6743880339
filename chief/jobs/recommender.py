"""Example job: a recommender (click prediction) with embedding tables, the workload parameter servers exist for.

The template for real embedding workloads: a user id and an item id, each looked up in its own
table, a few categorical features with small tables, an MLP on top, two logits (no click, click).
Each step touches a few hundred rows of each table, so only those rows cross the network and are
updated (README, Embeddings). Data is synthetic and shipped as code: ids follow a power law (a few
users and items are very frequent, most are rare, as in real logs), and the click depends on a hidden
user-item affinity plus the categorical features, so there is something to learn.

`--job chief.jobs.recommender` trains the default sizes (1 M users, 200 k items);
`--job chief.jobs.recommender:small` a small version (tests, a quick look).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import tensorflow as tf
import tf_keras

FEATURE_CARDINALITIES = (7, 24, 50)  # e.g. day of week, hour of day, country


@dataclass(frozen=True)
class Recommender:
    users: int = 1_000_000
    items: int = 200_000
    dim: int = 32
    examples: int = 65_536
    eval_examples: int = 8_192
    zipf: float = 1.2  # the power law of id frequencies
    seed: int = 7

    def model_fn(self) -> tf_keras.Model:
        """ids [user, item, feature_0, ...] -> 2 logits."""
        ids = tf_keras.Input(shape=(2 + len(FEATURE_CARDINALITIES),), dtype="int32", name="ids")
        user = tf_keras.layers.Embedding(self.users, self.dim, name="user_embedding")(ids[:, 0])
        item = tf_keras.layers.Embedding(self.items, self.dim, name="item_embedding")(ids[:, 1])
        features = [
            tf_keras.layers.Embedding(cardinality, 4, name=f"feature_{k}_embedding")(ids[:, 2 + k])
            for k, cardinality in enumerate(FEATURE_CARDINALITIES)
        ]
        hidden = tf_keras.layers.Concatenate()([user, item, user * item, *features])
        hidden = tf_keras.layers.Dense(64, activation="relu")(hidden)
        return tf_keras.Model(ids, tf_keras.layers.Dense(2)(hidden))

    def loss_fn(self, y_true, y_pred):
        return tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True))

    def optimizer_fn(self):
        # Adagrad updates only the rows in a sparse gradient (README, Embeddings: optimizers).
        return tf_keras.optimizers.legacy.Adagrad(learning_rate=0.1)

    def train_data(self) -> tuple[np.ndarray, np.ndarray]:
        return self._data[0]

    def eval_data(self) -> tuple[np.ndarray, np.ndarray]:
        return self._data[1]

    @cached_property
    def _data(self):
        rng = np.random.default_rng(self.seed)
        user_taste = rng.normal(size=(self.users, 4)).astype(np.float32)  # hidden, small: O(users x 4)
        item_taste = rng.normal(size=(self.items, 4)).astype(np.float32)
        feature_bias = [rng.normal(size=c).astype(np.float32) for c in FEATURE_CARDINALITIES]

        def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
            users = (rng.zipf(self.zipf, n) - 1) % self.users
            items = (rng.zipf(self.zipf, n) - 1) % self.items
            features = [rng.integers(0, c, n) for c in FEATURE_CARDINALITIES]
            score = np.sum(user_taste[users] * item_taste[items], axis=1) + sum(
                b[f] for b, f in zip(feature_bias, features, strict=True)
            )
            clicks = (score + rng.normal(scale=0.5, size=n) > 0).astype(np.int32)
            return np.stack([users, items, *features], axis=1).astype(np.int32), clicks

        return draw(self.examples), draw(self.eval_examples)


default = Recommender()
# Small, but its user table (625 KiB) is still sharded when there are 2 ps.
small = Recommender(users=20_000, items=2_000, dim=8, examples=4_096, eval_examples=1_024)
model_fn, loss_fn, optimizer_fn = default.model_fn, default.loss_fn, default.optimizer_fn
train_data, eval_data = default.train_data, default.eval_data
