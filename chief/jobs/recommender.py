"""Example job: a recommender (click prediction) with embedding tables, the workload parameter servers exist for.

The template for real embedding workloads: a user id and an item id, each looked up in its own
table, a few categorical features with small tables, an MLP on top, two logits (no click, click).
Each step touches a few hundred rows of each table, so only those rows cross the network and are
updated (docs/embeddings.md). Data is synthetic and shipped as code: ids follow a power law (a few
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

FEATURES = {"day_of_week": 7, "hour": 24, "country": 50}  # categorical features and their cardinalities


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
        """Named inputs {user, item, day_of_week, hour, country} (int ids, one per example) -> 2 logits."""
        inputs = {name: tf_keras.Input(shape=(), dtype="int32", name=name) for name in ("user", "item", *FEATURES)}
        user = tf_keras.layers.Embedding(self.users, self.dim, name="user_embedding")(inputs["user"])
        item = tf_keras.layers.Embedding(self.items, self.dim, name="item_embedding")(inputs["item"])
        features = [tf_keras.layers.Embedding(n, 4, name=f"{name}_embedding")(inputs[name]) for name, n in FEATURES.items()]
        hidden = tf_keras.layers.Concatenate()([user, item, user * item, *features])
        hidden = tf_keras.layers.Dense(64, activation="relu")(hidden)
        return tf_keras.Model(inputs, tf_keras.layers.Dense(2)(hidden))

    def loss_fn(self, y_true, y_pred):
        return tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True))

    def optimizer_fn(self):
        # Adagrad updates only the rows in a sparse gradient (docs/embeddings.md: optimizers).
        return tf_keras.optimizers.legacy.Adagrad(learning_rate=0.1)

    def train_data(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        return self._data[0]

    def eval_data(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        return self._data[1]

    @cached_property
    def _data(self):
        rng = np.random.default_rng(self.seed)
        user_taste = rng.normal(size=(self.users, 4)).astype(np.float32)  # hidden, small: O(users x 4)
        item_taste = rng.normal(size=(self.items, 4)).astype(np.float32)
        bias = {name: rng.normal(size=n).astype(np.float32) for name, n in FEATURES.items()}

        def draw(n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
            ids = {"user": (rng.zipf(self.zipf, n) - 1) % self.users, "item": (rng.zipf(self.zipf, n) - 1) % self.items}
            ids |= {name: rng.integers(0, count, n) for name, count in FEATURES.items()}
            score = np.sum(user_taste[ids["user"]] * item_taste[ids["item"]], axis=1) + sum(bias[k][ids[k]] for k in FEATURES)
            clicks = (score + rng.normal(scale=0.5, size=n) > 0).astype(np.int32)
            return {name: column.astype(np.int32) for name, column in ids.items()}, clicks

        return draw(self.examples), draw(self.eval_examples)


default = Recommender()
# Small, but its user table (625 KiB) is still sharded when there are 2 ps.
small = Recommender(users=20_000, items=2_000, dim=8, examples=4_096, eval_examples=1_024)
model_fn, loss_fn, optimizer_fn = default.model_fn, default.loss_fn, default.optimizer_fn
train_data, eval_data = default.train_data, default.eval_data
