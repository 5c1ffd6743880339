"""Jobs written from TensorFlow's and Keras's own guides, for the guide-pattern matrix
(tests/system/test_guide_patterns.py). Tiny data, tiny models: each case trains a few steps.

- `PssTutorial`: TF's ParameterServerStrategy tutorial (tensorflow.org/tutorials/distribute/
  parameter_server_training): StringLookup layers for the features and the label applied in the
  training dataset's `map`, created in `train_dataset()`, shuffled (read as a stream); an Embedding,
  a one-unit sigmoid with an L2 kernel regularizer, RMSprop, binary cross-entropy, Accuracy on the
  thresholded predictions. `PssTutorialAsWritten`: the same, its `dataset_fn`'s `.batch(32).repeat()`
  kept (pstrain takes the batches apart) and its eval set batched.
- `PssHashingByPosition`: the same data through Hashing + IntegerLookup (and an IntegerLookup for
  the label), adapted in `train_dataset()`, not shuffled; no metrics (the default accuracy is Keras's
  binary one).
- `BuiltInMethods`: Keras's "Training & evaluation with the built-in methods" guide: a functional
  model compiled with RMSprop, SparseCategoricalCrossentropy, SparseCategoricalAccuracy, its
  ActivityRegularizationLayer (`self.add_loss` in `call()`) and a Dense with `activity_regularizer`,
  sample weights.
- `PreprocessingInModel` / `PreprocessingInDataset`: Keras's "Working with preprocessing layers"
  guide: an adapted Normalization, a TextVectorization and a StringLookup (one-hot) inside the model,
  one-hot labels without metrics (no accuracy); the same layers in the dataset's `map`
  (TextVectorization adapted in `train_dataset()`), compiled with `metrics=["accuracy"]` (categorical).
- `SparseNoMetrics`: a softmax classifier with integer labels and no metrics (the sparse accuracy).
- `AddMetric`: the built-in methods guide's MetricLoggingLayer (`self.add_metric` in `call()`): refused.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf
import tf_keras

FEATURES = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
LABELS = ["yes", "no"]


def pss_examples(n: int, seed: int) -> dict[str, np.ndarray]:
    """The tutorial's generator: three distinct features, label "yes" when "avenger" is among them."""
    rng = np.random.default_rng(seed)
    features = np.array([rng.choice(FEATURES, 3, replace=False) for _ in range(n)])
    return {"features": features, "label": np.array([["yes"] if "avenger" in f else ["no"] for f in features])}


def pss_model(vocabulary_size: int) -> tf_keras.Model:
    model_input = tf_keras.Input(shape=(3,), dtype=tf.int64, name="features")
    embedded = tf_keras.layers.Embedding(vocabulary_size, 8)(model_input)
    pooled = tf_keras.layers.GlobalAveragePooling1D()(embedded)
    dense = tf_keras.layers.Dense(1, activation="sigmoid", kernel_regularizer=tf_keras.regularizers.L2(1e-4))
    return tf_keras.Model({"features": model_input}, dense(pooled))


class PssTutorial:
    @staticmethod
    def train_dataset():
        feature_lookup = tf_keras.layers.StringLookup(vocabulary=FEATURES, mask_token=None)
        label_lookup = tf_keras.layers.StringLookup(vocabulary=LABELS, num_oov_indices=0, mask_token=None)
        raw = tf.data.Dataset.from_tensor_slices(pss_examples(200, 0))
        return raw.map(lambda x: ({"features": feature_lookup(x["features"])}, label_lookup(x["label"]))).shuffle(200, seed=1)

    @staticmethod
    def eval_dataset():
        feature_lookup = tf_keras.layers.StringLookup(vocabulary=FEATURES, mask_token=None)
        label_lookup = tf_keras.layers.StringLookup(vocabulary=LABELS, num_oov_indices=0, mask_token=None)
        raw = tf.data.Dataset.from_tensor_slices(pss_examples(64, 1))
        return raw.map(lambda x: ({"features": feature_lookup(x["features"])}, label_lookup(x["label"])))

    @staticmethod
    def model_fn():
        model = pss_model(len(FEATURES) + 1)
        model.compile(
            optimizer=tf_keras.optimizers.legacy.RMSprop(learning_rate=0.1),
            loss="binary_crossentropy",
            metrics=[tf_keras.metrics.BinaryAccuracy(name="accuracy")],
        )
        return model


class PssTutorialAsWritten(PssTutorial):
    """The tutorial's `dataset_fn` as it is written: its examples shuffled, batched and repeated
    (`.shuffle(200).batch(32).repeat()`, the shuffle given a seed); its eval set batched as `evaluate` takes it."""

    @staticmethod
    def train_dataset():
        return PssTutorial.train_dataset().batch(32).repeat()

    @staticmethod
    def eval_dataset():
        return PssTutorial.eval_dataset().batch(8)


@functools.cache
def hashed_ids() -> tuple[tf_keras.layers.Layer, tf_keras.layers.Layer]:
    """Hashing and an IntegerLookup adapted to the hashed training features: adapted once, outside the
    pipeline (pstrain builds it inside functions too, where Keras refuses adapt)."""
    hashing = tf_keras.layers.Hashing(num_bins=32)
    ids = tf_keras.layers.IntegerLookup()
    ids.adapt(hashing(pss_examples(200, 0)["features"].reshape(-1)))
    return hashing, ids


class PssHashingByPosition:
    @staticmethod
    def pipeline(examples):
        hashing, ids = hashed_ids()
        label_lookup = tf_keras.layers.IntegerLookup(vocabulary=[0, 1], num_oov_indices=0)
        raw = tf.data.Dataset.from_tensor_slices(
            ({"features": examples["features"]}, (examples["label"][:, 0] == "yes").astype(np.int64))
        )
        return raw.map(lambda x, y: ({"features": ids(hashing(x["features"]))}, label_lookup(y)))

    @classmethod
    def train_dataset(cls):
        return cls.pipeline(pss_examples(200, 0))

    @classmethod
    def eval_dataset(cls):
        return cls.pipeline(pss_examples(64, 1))

    @staticmethod
    def model_fn():
        return pss_model(33)

    loss_fn = tf_keras.losses.BinaryCrossentropy()

    @staticmethod
    def optimizer_fn():
        return tf_keras.optimizers.legacy.RMSprop(learning_rate=0.05)


def digits_like(n: int, seed: int, classes: int = 3):
    """A small classification set: 6 features, `classes` classes, per-example weights."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = np.digitize(x[:, 0] + 0.5 * x[:, 1], np.linspace(-0.6, 0.6, classes - 1)).astype(np.int64)
    return x, y, rng.uniform(0.5, 2.0, n).astype(np.float32)


class ActivityRegularizationLayer(tf_keras.layers.Layer):
    """The built-in methods guide's layer: a loss added in call()."""

    def call(self, inputs):
        self.add_loss(tf.reduce_sum(inputs) * 0.1)
        return inputs


class BuiltInMethods:
    @staticmethod
    def model_fn():
        inputs = tf_keras.Input(shape=(6,), name="digits")
        x = tf_keras.layers.Dense(16, activation="relu", name="dense_1")(inputs)
        x = ActivityRegularizationLayer()(x)
        x = tf_keras.layers.Dense(16, activation="relu", activity_regularizer=tf_keras.regularizers.L2(1e-2), name="dense_2")(x)
        outputs = tf_keras.layers.Dense(3, activation="softmax", name="predictions")(x)
        model = tf_keras.Model(inputs=inputs, outputs=outputs)
        model.compile(
            optimizer=tf_keras.optimizers.legacy.RMSprop(learning_rate=1e-3),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(),
            metrics=[tf_keras.metrics.SparseCategoricalAccuracy()],
        )
        return model

    @staticmethod
    def train_data():
        return digits_like(256, 0)

    @staticmethod
    def eval_data():
        return digits_like(96, 1)[:2]


def text_examples(n: int, seed: int):
    rng = np.random.default_rng(seed)
    number = rng.normal(size=(n, 2)).astype(np.float32) * 3.0 + 5.0
    colour = rng.choice(["red", "green", "blue"], n)
    words = np.array([f"{'good' if c == 'red' else 'bad'} w{i}" for c, i in zip(colour, rng.integers(0, 5, n), strict=True)])
    label = ((number[:, 0] > 5.0).astype(np.int64) + (colour == "red")).astype(np.int64)  # 0, 1 or 2
    return {"number": number, "colour": colour[:, None], "words": words}, label


class PreprocessingInModel:
    @staticmethod
    def model_fn():
        features, _ = text_examples(256, 0)
        norm = tf_keras.layers.Normalization()
        norm.adapt(features["number"])
        vectorize = tf_keras.layers.TextVectorization(max_tokens=10, output_mode="multi_hot")
        vectorize.adapt(features["words"])
        lookup = tf_keras.layers.StringLookup(vocabulary=["red", "green", "blue"], output_mode="one_hot")
        number = tf_keras.Input((2,), name="number")
        colour = tf_keras.Input((1,), dtype="string", name="colour")  # one_hot takes [batch, 1]
        words = tf_keras.Input((), dtype="string", name="words")
        x = tf_keras.layers.Concatenate()([norm(number), lookup(colour), vectorize(words)])
        x = tf_keras.layers.Dense(8, activation="relu")(x)
        model = tf_keras.Model({"number": number, "colour": colour, "words": words}, tf_keras.layers.Dense(3)(x))
        model.compile(optimizer="adam", loss=tf_keras.losses.CategoricalCrossentropy(from_logits=True))
        return model

    @staticmethod
    def train_data():
        features, label = text_examples(256, 0)
        return features, np.eye(3, dtype=np.float32)[label]  # one-hot labels, no metrics: no accuracy

    @staticmethod
    def eval_data():
        features, label = text_examples(64, 1)
        return features, np.eye(3, dtype=np.float32)[label]


@functools.cache
def adapted_vectorizer() -> tf_keras.layers.TextVectorization:
    vectorize = tf_keras.layers.TextVectorization(max_tokens=10, output_mode="multi_hot")
    vectorize.adapt(text_examples(256, 0)[0]["words"])
    return vectorize


class AdaptInDataset:
    """adapt() inside train_dataset(), as a script adapts before building its dataset: refused."""

    @staticmethod
    def train_dataset():
        features, label = text_examples(256, 0)
        vectorize = tf_keras.layers.TextVectorization(max_tokens=10, output_mode="multi_hot")
        vectorize.adapt(features["words"])
        return tf.data.Dataset.from_tensor_slices((features["words"], label)).map(lambda w, y: (vectorize(w), y))

    model_fn = staticmethod(lambda: tf_keras.Sequential([tf_keras.Input((8,)), tf_keras.layers.Dense(3)]))
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer_fn = staticmethod(lambda: tf_keras.optimizers.legacy.SGD(0.1))


class PreprocessingInDataset:
    @staticmethod
    def pipeline(features, label):
        norm = tf_keras.layers.Normalization(mean=[5.0, 5.0], variance=[9.0, 9.0])
        vectorize = adapted_vectorizer()
        lookup = tf_keras.layers.StringLookup(vocabulary=["red", "green", "blue"], output_mode="one_hot")
        raw = tf.data.Dataset.from_tensor_slices((features, np.eye(3, dtype=np.float32)[label]))
        return raw.map(lambda x, y: (tf.concat([norm(x["number"]), lookup(x["colour"]), vectorize(x["words"])], axis=-1), y))

    @classmethod
    def train_dataset(cls):
        return cls.pipeline(*text_examples(256, 0))

    @classmethod
    def eval_dataset(cls):
        return cls.pipeline(*text_examples(64, 1))

    @staticmethod
    def model_fn():
        model = tf_keras.Sequential(
            [tf_keras.Input((2 + 4 + 8,)), tf_keras.layers.Dense(8, activation="relu"), tf_keras.layers.Dense(3)]
        )
        model.compile(
            optimizer=tf_keras.optimizers.legacy.Adam(1e-2),
            loss=tf_keras.losses.CategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],  # one-hot labels: Keras's categorical accuracy
        )
        return model


class SparseNoMetrics:
    """A small softmax classifier with integer labels, compiled without metrics: the default accuracy is
    Keras's sparse categorical one."""

    @staticmethod
    def model_fn():
        model = tf_keras.Sequential(
            [tf_keras.Input((6,)), tf_keras.layers.Dense(8, activation="relu"), tf_keras.layers.Dense(3, "softmax")]
        )
        model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.1), loss="sparse_categorical_crossentropy")
        return model

    @staticmethod
    def train_data():
        return digits_like(256, 0)[:2]

    @staticmethod
    def eval_data():
        return digits_like(64, 1)[:2]


class MetricLoggingLayer(tf_keras.layers.Layer):
    """The built-in methods guide's layer: a metric added in call()."""

    def call(self, inputs):
        self.add_metric(tf_keras.backend.std(inputs), name="std_of_activation", aggregation="mean")
        return inputs


class AddMetric(BuiltInMethods):
    @staticmethod
    def model_fn():
        inputs = tf_keras.Input(shape=(6,), name="digits")
        x = MetricLoggingLayer()(tf_keras.layers.Dense(16, activation="relu")(inputs))
        model = tf_keras.Model(inputs, tf_keras.layers.Dense(3, activation="softmax")(x))
        model.compile(optimizer=tf_keras.optimizers.legacy.RMSprop(1e-3), loss="sparse_categorical_crossentropy")
        return model


class LossFactory(SparseNoMetrics):
    """`loss_fn` written as a factory, as `optimizer_fn` is."""

    @staticmethod
    def loss_fn():
        return tf_keras.losses.SparseCategoricalCrossentropy()


class BatchedNoInput:
    """A dataset batched with drop_remainder=True and a model without an Input (pstrain takes the batches apart)."""

    @staticmethod
    def train_dataset():
        x, y, _ = digits_like(256, 0)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)

    @staticmethod
    def model_fn():
        return tf_keras.Sequential([tf_keras.layers.Dense(8, activation="relu"), tf_keras.layers.Dense(3)])

    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @staticmethod
    def optimizer_fn():
        return tf_keras.optimizers.legacy.SGD(0.1)


class TokenSequences(BatchedNoInput):
    """The text-generation tutorial's pipeline: a stream of token ids batched into sequences, then split
    into (input, target): each batch is one example."""

    @staticmethod
    def train_dataset():
        ids = tf.data.Dataset.from_tensor_slices(np.arange(600, dtype=np.int64) % 7)
        return ids.batch(6, drop_remainder=True).map(lambda seq: (seq[:-1], seq[1:]))
