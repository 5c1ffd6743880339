"""keras.io's "Simple MNIST convnet", written with Keras 3 (`import keras`), on the shipped 8x8 digits.

The example's model, `compile` and one-hot labels, unchanged but for the input size: pstrain takes the
loss, optimizer and metrics from `compile()`, and the job only says where the data is. Its Dropout
draws per (seed, step, slot), so `pstrain launch` ends equal to `pstrain train --standalone`.
"""

from __future__ import annotations

import keras
import numpy as np

from chief.jobs import digits

NUM_CLASSES = 10


def one_hot(data: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    images, labels = data
    return images, keras.utils.to_categorical(labels, NUM_CLASSES).astype(np.float32)


def train_data() -> tuple[np.ndarray, np.ndarray]:
    return one_hot(digits.train_data())


def eval_data() -> tuple[np.ndarray, np.ndarray]:
    return one_hot(digits.eval_data())


def model_fn() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Conv2D(64, kernel_size=(2, 2), activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(NUM_CLASSES, activation="softmax"),
        ]
    )
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model
