"""The digits job read from image files: the template for a folder of images.

The same 8x8 digits as `chief.jobs.digits`, written once as PNG files (one per example) and read
on the workers with `tf.io.decode_png`. Pixel values 0..16 are stored as 0..240 and decoded back to
the array job's values exactly, so this job trains to the same model as the array job.

Layout (what `write_pngs` makes; an image folder of your own is converted into it once):

    DIR/train/00000.png ... DIR/train/01437.png   example i is the file named i
    DIR/train/labels.txt                          one label per line, line i for example i
    DIR/eval/...                                  the same for the held-out images

File names follow from the index, so the dataset graph stays the same size whatever the number of
files (`Dataset.range(n).map(read)`); the labels are read once per worker. DIR is
`$PSTRAIN_DATA_DIR/digits-png` (default `~/.cache/pstrain/digits-png`), written at first use on the
chief's machine; on other machines run `python -m chief.jobs.digits_files` first (or share DIR).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

from chief.jobs import digits
from chief.jobs.digits import loss_fn, model_fn, optimizer_fn  # noqa: F401  (the same model)
from cluster.taskenv import Switches

SCALE = 15  # 0..16 stored as 0..240: v * 15 / 240 == v / 16 exactly in float32


def data_dir() -> Path:
    return Switches.from_env().data_dir / "digits-png"


def write_pngs(directory: Path) -> None:
    """Write the digits as PNG files plus labels.txt (atomically: a finished directory or none)."""
    if (directory / "done").exists():
        return
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for split, (features, labels) in (("train", digits.train_data()), ("eval", digits.eval_data())):
        (tmp / split).mkdir(parents=True)
        pixels = np.rint(features * 16 * SCALE).astype(np.uint8)
        for i, image in enumerate(pixels):
            tf.io.write_file(str(tmp / split / f"{i:05d}.png"), tf.io.encode_png(image))
        (tmp / split / "labels.txt").write_text("".join(f"{int(y)}\n" for y in labels))
    (tmp / "done").write_text("")
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)


def image_dataset(split: str) -> tf.data.Dataset:
    """Example i: (the decoded image i, label i). Runs on each worker, against its own files."""
    directory = data_dir()
    write_pngs(directory)  # on the chief's machine, at first use
    folder = str(directory / split)
    count = len((directory / split / "labels.txt").read_text().split())  # on the chief: the set's size
    labels = tf.strings.to_number(tf.strings.split(tf.io.read_file(folder + "/labels.txt")), tf.int32)

    def read(i):
        path = tf.strings.join([folder, "/", tf.strings.as_string(i, width=5, fill="0"), ".png"])
        image = tf.io.decode_png(tf.io.read_file(path))
        image = tf.ensure_shape(tf.cast(image, tf.float32) / (16.0 * SCALE), [8, 8, 1])
        return image, labels[i]

    return tf.data.Dataset.range(count).map(read)


def train_dataset() -> tf.data.Dataset:
    return image_dataset("train")


def eval_dataset() -> tf.data.Dataset:
    return image_dataset("eval")


if __name__ == "__main__":  # python -m chief.jobs.digits_files [DIR]: write the files on this machine
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else data_dir()
    write_pngs(target)
    print(f"digits written as PNG files to {target}")
