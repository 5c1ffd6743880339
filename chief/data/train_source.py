"""The job's choice of training data as a source (`train_source`: by position, as a stream, or from
arrays), and one line for a data error raised in a worker's closure (`explain_worker_error`)."""

from __future__ import annotations

import logging
import re

import tensorflow as tf

from chief.contract.arrays import checked_arrays
from cluster.rundir import RunDir
from worker.input.datasets import DatasetSource
from worker.input.sources import MISMATCH_TAG, DataError
from worker.input.streams import StreamSource
from worker.input.tables import TableSource

log = logging.getLogger("pstrain.chief")


def train_source(job, run_dir: RunDir | None, train=None):
    """The job's training data as a source: train_dataset() (by position, or as a stream:
    worker/input/streams.py), train_arrays() or train_data(). `train` (TrainConfig) sets a stream's slot
    batch and slots; without it (the evaluator sidecar) a stream can only give its first examples."""
    if job.train_dataset:
        what = f"--job {job.spec}: train_dataset()"
        probe, batch = DatasetSource.examples(job.train_dataset, what)
        if batch is not None and train is not None:
            note_batches(what, batch, train.global_batch_size)
        # Batches taken apart are a stream: the pipeline's order, as Keras's fit reads a dataset of batches.
        if batch is None and (probe.cardinality().numpy() == 0 or DatasetSource.random_access(probe)):
            return DatasetSource(job.train_dataset, what)
        slots = (train.slot_batch_size, train.total_num_replicas) if train else (0, 0)
        log.info(
            "%s is read as a stream, in the pipeline's own order (a shuffle, a random map, a table or variable "
            "in a map, a .batch(), or no known size: docs/data.md); pstrain does not shuffle it: shuffle with a seed in it",
            what,
        )
        return StreamSource(job.train_dataset, what, run_dir.stream_record if train and run_dir else None, *slots)
    if job.train_arrays:
        return TableSource.from_npy_paths(job.train_arrays(), f"--job {job.spec}: train_arrays()")
    return TableSource.from_arrays(checked_arrays(job.spec, "train_data", job.train_data()), run_dir.data)


def note_batches(what: str, batch: int, global_batch_size: int) -> None:
    """Say that the pipeline's batches of `batch` are taken apart (worker/input/datasets.py
    `single_examples`): in the log, and on the console where pstrain's batch is another size."""
    line = (
        f"{what} batches its examples ({batch} at a time): pstrain takes them one by one, in the pipeline's "
        f"order, and batches them to train.global_batch_size = {global_batch_size}"
    )
    if batch == global_batch_size:
        log.info("%s", line)
    else:
        print(f"pstrain: warning: {line}; give --global-batch-size {batch} for the pipeline's batches", flush=True)


_TASK = re.compile(r"/job:worker/replica:\d+/task:(\d+)")
_MISSING = re.compile(r"([^\s:;]+); No such file or directory")
_MISMATCH = re.compile(
    MISMATCH_TAG + r"\] \[worker\] \[(\d+)\] \[cardinality\] \[(-?\d+)\] \[(-?\d+)\] \[digest\] \[(-?\d+)\] \[(-?\d+)\]"
)


def explain_worker_error(error: tf.errors.OpError, workers: list[str]) -> DataError | None:
    """One line for a data error raised in a closure (a missing file, a fingerprint mismatch), else None."""
    message = error.message or ""
    if match := _MISMATCH.search(message):
        worker, card, want_card, found, want = (int(g) for g in match.groups())
        same = f"the same {card} examples but different content" if card >= 0 else "different first examples"
        what = (
            f"{card} examples, the chief expects {want_card}"
            if card != want_card
            else f"{same} (digest {found:#x}, the chief's {want:#x})"
        )
        return DataError(
            f"worker {worker} ({_host(workers, worker)}): its training data differs from the chief's: {what}; "
            "give every machine the same files"
        )
    if isinstance(error, tf.errors.NotFoundError) and (missing := _MISSING.search(message)):
        task = _TASK.search(message)
        where = f"worker {task.group(1)} ({_host(workers, int(task.group(1)))})" if task else "this process (the chief)"
        return DataError(
            f"{where}: data file {missing.group(1)} not found; every machine reads the job's files from its own disk "
            "(copy them there or use a shared mount)"
        )
    return None


def _host(workers: list[str], index: int) -> str:
    return workers[index] if 0 <= index < len(workers) else "unknown host"
