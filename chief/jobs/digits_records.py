"""The digits job read from TFRecord files: the template for a tf.data pipeline read as a stream.

The same 8x8 digits as `chief.jobs.digits`, written once as 4 TFRecord files of `tf.train.Example`s
(`pixels`: 64 floats, `label`: an int) and read with the usual pipeline: `list_files` (in a fixed
order), `interleave(TFRecordDataset)`, `parse_single_example`. Such a pipeline cannot be read by
position, so pstrain reads it as a stream on every worker (worker/input/streams.py): each worker opens its
own copy of the files. The order is the pipeline's; shuffle the records when you write them, or add
`shuffle(buffer, seed=S)` to the pipeline (a fixed seed: the order must be the same on every worker).

DIR is `$PSTRAIN_DATA_DIR/digits-tfrecord` (default `~/.cache/pstrain/digits-tfrecord`), written at
first use on the chief's machine; on other machines run `python -m chief.jobs.digits_records` first.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import tensorflow as tf

from chief.jobs import digits
from chief.jobs.digits import loss_fn, model_fn, optimizer_fn  # noqa: F401  (the same model)
from cluster.taskenv import Switches

SHARDS = 4
FEATURES = {"pixels": tf.io.FixedLenFeature([64], tf.float32), "label": tf.io.FixedLenFeature([], tf.int64)}


def data_dir() -> Path:
    return Switches.from_env().data_dir / "digits-tfrecord"


def write_records(directory: Path) -> None:
    """Write each split as SHARDS TFRecord files, example i in shard i % SHARDS (atomically)."""
    if (directory / "done").exists():
        return
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for split, (features, labels) in (("train", digits.train_data()), ("eval", digits.eval_data())):
        writers = [tf.io.TFRecordWriter(str(tmp / f"{split}-{s}-of-{SHARDS}.tfrecord")) for s in range(SHARDS)]
        for i, (image, label) in enumerate(zip(features.reshape(len(labels), 64), labels, strict=True)):
            example = tf.train.Example(
                features=tf.train.Features(
                    feature={
                        "pixels": tf.train.Feature(float_list=tf.train.FloatList(value=image)),
                        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
                    }
                )
            )
            writers[i % SHARDS].write(example.SerializeToString())
        for writer in writers:
            writer.close()
    (tmp / "done").write_text("")
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)


def parse(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    example = tf.io.parse_single_example(record, FEATURES)
    return tf.reshape(example["pixels"], [8, 8, 1]), tf.cast(example["label"], tf.int32)


def records(split: str) -> tf.data.Dataset:
    """The split's examples in their original order (example i is record i // SHARDS of shard i % SHARDS,
    and the interleave takes one record from each shard in turn). Runs on each worker, against its own files."""
    directory = data_dir()
    write_records(directory)  # on the chief's machine, at first use
    files = tf.data.Dataset.list_files(str(directory / f"{split}-*.tfrecord"), shuffle=False)  # a fixed order
    reads = files.interleave(tf.data.TFRecordDataset, cycle_length=SHARDS, num_parallel_calls=tf.data.AUTOTUNE)
    return reads.map(parse, num_parallel_calls=tf.data.AUTOTUNE)


def train_dataset() -> tf.data.Dataset:
    return records("train")


def eval_dataset() -> tf.data.Dataset:
    return records("eval")


if __name__ == "__main__":  # python -m chief.jobs.digits_records [DIR]: write the files on this machine
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else data_dir()
    write_records(target)
    print(f"digits written as TFRecord files to {target}")
