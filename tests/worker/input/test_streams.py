"""A train_dataset() read as a stream (worker/input/streams.py): its order, epochs, resume and refusals in one
process, and closures on a real (in-process) TF cluster that read each batch of the stream exactly."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from chief.contract.job import JobError, load_job
from chief.data.train_source import train_source
from chief.step.strategy import PeeredPSStrategy
from cluster.config import TrainConfig
from cluster.rundir import RunDir
from worker.input.sources import DataError
from worker.input.streams import StreamSource

KEPT = [i for i in range(20) if i % 4 != 3]  # 15 examples: 3 batches of 4 per epoch, 3 examples dropped


def filtered() -> tf.data.Dataset:
    return tf.data.Dataset.range(20).filter(lambda i: i % 4 != 3).map(lambda i: (tf.cast(i, tf.float32)[None], i))


def stream(run_dir=None) -> StreamSource:
    return StreamSource(filtered, "train_dataset()", RunDir(run_dir).stream_record if run_dir else None, slot_batch=4, slots=2)


def read(source: StreamSource, first_step: int, count: int) -> list[tuple[list[int], list[int]]]:
    source.begin(first_step)
    batches = source.local_batches()
    out = []
    for _ in range(count):
        where, (_, labels) = next(batches)
        out.append((where.tolist(), labels.numpy().tolist()))
    return out


@pytest.mark.pure
def test_epochs_drop_the_partial_batch_and_steps_run_on_across_them(tmp_path):
    source = stream(tmp_path)
    got = read(source, 0, 8)
    assert got == [([j, j // 3, j % 3], KEPT[4 * (j % 3) : 4 * (j % 3) + 4]) for j in range(8)]
    assert source.batches_per_epoch is None
    source.observe([where for where, _ in got])
    assert source.batches_per_epoch == 3 and [source.epoch_of(s) for s in range(5)] == [0, 0, 1, 2, 2]
    assert json.loads(RunDir(tmp_path).stream_record.read_text()) == {"slot_batch_size": 4, "batches_per_epoch": 3}
    # A resume at step 5 (batch 10): from the recorded epoch length, or from the stream's start without it.
    continued = read(stream(tmp_path), 5, 4)
    assert continued == [([j, j // 3, j % 3], KEPT[4 * (j % 3) : 4 * (j % 3) + 4]) for j in range(10, 14)]
    assert read(stream(), 5, 4) == continued


@pytest.mark.pure
def test_a_pipeline_that_repeats_itself_is_one_endless_epoch():
    source = StreamSource(lambda: filtered().repeat(), "train_dataset()", None, slot_batch=4, slots=2)
    got = read(source, 0, 6)
    assert [where for where, _ in got] == [[j, 0, j] for j in range(6)]
    assert got[3][1] == KEPT[12:] + KEPT[:1]  # the 4th batch runs on into the repetition
    source.observe([where for where, _ in got])
    assert source.batches_per_epoch is None and source.epoch_of(100) == 0


@pytest.mark.pure
def test_epochs_of_different_lengths_stop_the_run():
    source = stream()
    source.observe([[3, 1, 0]])
    with pytest.raises(DataError, match="stream batch 7 is batch 0 of epoch 2, but epochs had 3 batches of 4"):
        source.observe([[7, 2, 0]])


@pytest.mark.pure
def test_an_order_that_is_not_fixed_and_a_pipeline_shorter_than_a_batch_are_refused():
    unseeded = tf.data.Dataset.range(100).shuffle(100).map(lambda i: (i, i))
    with pytest.raises(JobError, match="two builds of the pipeline gave different first examples; its order must be fixed"):
        StreamSource(lambda: unseeded.filter(lambda x, y: x >= 0), "train_dataset()", None, 4, 2)
    short = StreamSource(lambda: filtered().take(3), "train_dataset()", None, 4, 2)
    with pytest.raises(JobError, match=r"fewer examples than one slot batch \(4\)"):
        short.first_batch()


class FilteredJob:
    model_fn = staticmethod(lambda: tf_keras.Sequential())  # unused here
    loss_fn = staticmethod(lambda *a: None)
    optimizer_fn = staticmethod(lambda: tf_keras.optimizers.legacy.SGD(0.1))
    train_dataset = staticmethod(filtered)


@pytest.mark.pure
def test_a_filtered_train_dataset_is_a_stream_and_the_evaluator_reads_its_first_examples(tmp_path):
    job = load_job("tests.worker.input.test_streams:FilteredJob")
    train = TrainConfig(job="x", global_batch_size=8, replicas_to_aggregate=2)
    assert isinstance(train_source(job, RunDir(tmp_path), train), StreamSource)
    _, labels = train_source(job, RunDir(tmp_path)).first(6)  # no TrainConfig: the sidecar's fallback eval set
    assert labels.numpy().tolist() == KEPT[:6]


@pytest.mark.inprocess
def test_closures_in_any_order_read_their_own_batch_on_the_workers(in_process_cluster):
    """Closures for batches 7, 6, ..., 0: every worker is soon past the batch asked for and reads it from
    a fresh pipeline; each gets exactly the batch the standalone stream has at that position."""
    source = stream()
    source.begin(0)
    expected = source.fingerprint()
    strategy = PeeredPSStrategy(in_process_cluster)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(source.dataset_fn))

    @tf.function
    def closure(iterator, step, slot):
        (_, labels), where, fresh = source.worker_batch(iterator, step, slot, expected)
        return labels, where, fresh

    order = list(range(7, -1, -1))
    steps_and_slots = [(tf.constant(j // 2, tf.int64), tf.constant(j % 2, tf.int64)) for j in order]
    results = [coordinator.schedule(closure, args=(iterator, *where)) for where in steps_and_slots]
    joined = threading.Thread(target=coordinator.join, daemon=True)  # join() itself has no time limit
    joined.start()
    joined.join(timeout=120)
    assert not joined.is_alive(), "the closures did not finish within 120 s"
    local = dict((w[0], labels) for w, labels in read(stream(), 0, 8))
    for j, remote in zip(order, results, strict=True):
        labels, where, _ = remote.fetch()
        assert where.tolist() == [j, j // 3, j % 3] and labels.tolist() == local[j], j
    # Each worker's first closure reads forward; every later one asks for a batch its worker is past.
    assert sum(bool(r.fetch()[2]) for r in results) >= len(order) - 2


@pytest.mark.pure
def test_a_worker_whose_stream_differs_is_named_in_one_line():
    """The message of the closure's failed check (tf.debugging.Assert's format) as the chief explains it."""
    from chief.data.train_source import explain_worker_error
    from worker.input.sources import MISMATCH_TAG

    message = f"assertion failed: [{MISMATCH_TAG}] [worker] [1] [cardinality] [-2] [-2] [digest] [5] [7]"
    error = explain_worker_error(tf.errors.InvalidArgumentError(None, None, message), ["h0:1", "h1:2"])
    assert str(error) == (
        "worker 1 (h1:2): its training data differs from the chief's: different first examples (digest 0x5, "
        "the chief's 0x7); give every machine the same files"
    )


def engines(resolver, run_dir, name: str = "filtered_regression", **train):
    """A ClusterEngine (in-process cluster) and a LocalEngine on tests/jobs/data_jobs.py's `name`, from step 0."""
    from chief.step.dispatch import ClusterEngine
    from chief.step.local import LocalEngine

    job = load_job(f"tests.jobs.data_jobs:{name}")
    config = TrainConfig(job=name, global_batch_size=16, replicas_to_aggregate=2, **train)
    source = train_source(job, RunDir(run_dir / "cluster"), config)
    sample = tf.nest.map_structure(lambda t: t.numpy(), source.first(1)[0])
    cluster = ClusterEngine(job, config, source, sample, resolver=resolver)
    local = LocalEngine(job, config, train_source(job, RunDir(run_dir / "local"), config), sample)
    for engine in (cluster, local):
        engine.prepare(0)
    return cluster, local


@pytest.mark.inprocess
def test_a_stream_trains_on_the_in_process_cluster_as_standalone_across_epoch_ends(in_process_cluster, tmp_path):
    """9 batches an epoch and 2 slots: steps 4 and 8 hold batches of two epochs."""
    for sub in ("cluster", "local"):
        (tmp_path / sub).mkdir()
    cluster, local = engines(in_process_cluster, tmp_path, total_num_replicas=2)
    results = list(zip(cluster.run(0, 1) + cluster.run(1, 7) + cluster.run(8, 4), local.run(0, 12), strict=True))
    cluster.close()
    np.testing.assert_allclose([c.loss for c, _ in results], [s.loss for _, s in results], atol=1e-6)
    assert [c.epoch for c, _ in results] == [s.epoch for _, s in results] == [2 * k // 9 for k in range(12)]
    assert cluster.source.batches_per_epoch == local.source.batches_per_epoch == 9
    for got, want in zip(cluster.state.model.get_weights(), local.state.model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.inprocess
def test_a_stream_with_a_backup_slot_reads_every_batch_forward(in_process_cluster, tmp_path):
    """3 slots on 2 workers, 2 aggregated: every step applies 2, 3 batches a step are taken from the
    stream (the dropped slot's skipped), and a worker that runs two closures of a step reads both forward."""
    for sub in ("cluster", "local"):
        (tmp_path / sub).mkdir()
    cluster, _ = engines(in_process_cluster, tmp_path, total_num_replicas=3)
    results = cluster.run(0, 8)
    cluster.close()
    assert all(r.aggregated == 2 and r.applied for r in results)
    assert [r.epoch for r in results] == [3 * k // 9 for k in range(8)]
    assert sum(r.reread for r in results) == 0


@pytest.mark.inprocess
def test_a_stream_whose_map_branches_in_python_trains_as_standalone(in_process_cluster, tmp_path):
    """The job's pipeline is made inside the worker's closure too (a fresh pipeline for a worker past its
    batch), which pstrain traces with AutoGraph off: the job's `make()` still runs with AutoGraph on."""
    for sub in ("cluster", "local"):
        (tmp_path / sub).mkdir()
    cluster, local = engines(in_process_cluster, tmp_path, "branching_stream", total_num_replicas=2)
    results = list(zip(cluster.run(0, 1) + cluster.run(1, 7), local.run(0, 8), strict=True))
    cluster.close()
    np.testing.assert_allclose([c.loss for c, _ in results], [s.loss for _, s in results], atol=1e-6)
