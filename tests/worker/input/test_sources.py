"""Data sources (worker/input/sources.py) in one process: what a worker's TF ops read equals the local read."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from chief.contract.arrays import checked_arrays
from chief.contract.job import JobError, load_job
from cluster.config import ConfigError, TrainConfig
from cluster.rundir import check_compatible
from worker.input.datasets import DatasetSource
from worker.input.sources import digest
from worker.input.tables import NpyFile, TableSource, write_npy

pytestmark = pytest.mark.pure


def worker_read(source, indices):
    """What a closure does, minus the cluster: build on 'the worker' with TF ops, then read positions."""

    @tf.function
    def run(idx):
        cardinality, handle = source._build()
        return cardinality, source._read(handle, idx)

    return run(tf.constant(indices, tf.int64))


def test_npy_files_decode_on_the_worker_exactly_for_nested_features(tmp_path):
    arrays = (
        {
            "pixels": np.arange(5 * 3 * 2, dtype=np.float32).reshape(5, 3, 2),
            "flags": np.array([True, False, True, True, False]),
            "big_endian": np.arange(5, dtype=">i8"),
        },
        np.arange(5, dtype=np.int32) * 7,
    )
    leaves = []
    for i, leaf in enumerate(tf.nest.flatten(arrays)):
        write_npy(tmp_path / f"{i}.npy", leaf)
        leaves.append(str(tmp_path / f"{i}.npy"))
    paths = tf.nest.pack_sequence_as(arrays, leaves)
    source = TableSource.from_npy_paths(paths, "train_arrays()")
    assert source.num_examples == 5
    indices = np.array([4, 0, 2, 2])
    cardinality, remote = worker_read(source, indices)
    local = source.read_local(indices)
    assert int(cardinality) == 5
    for got, want, original in zip(tf.nest.flatten(remote), tf.nest.flatten(local), tf.nest.flatten(arrays), strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        np.testing.assert_array_equal(got.numpy(), original[indices])
    assert int(digest(remote)) == int(digest(local))


def test_train_data_arrays_are_written_once_and_read_back(tmp_path):
    x, y = np.random.default_rng(0).standard_normal((7, 3)).astype(np.float32), np.arange(7)
    source = TableSource.from_arrays((x, y), tmp_path / "data")
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["train-0.npy", "train-1.npy"]
    _, (gx, gy) = worker_read(source, [6, 1])
    np.testing.assert_array_equal(gx.numpy(), x[[6, 1]])
    np.testing.assert_array_equal(gy.numpy(), y[[6, 1]])


def test_text_columns_are_memory_mapped_and_decoded_on_the_worker_exactly(tmp_path):
    """train_data() text (str, bytes or object arrays, any shape) is written as fixed-width .npy, read by
    'the worker' as code points or bytes and decoded in-graph: the same strings as the local read."""
    words = np.array([["héllo", "a"], ["", "x\x00y"], ["zz", "日本"]])  # U: UTF-32, an embedded NUL kept
    raw = np.array([b"ab\xff", b"", b"a\x00b"], dtype=object)  # bytes that are not UTF-8
    numbers = np.arange(3, dtype=np.float32)
    data = checked_arrays("job", "train_data", ({"words": words, "raw": raw, "n": numbers}, numbers))
    assert data[0]["raw"].dtype.kind == "S" and data[0]["words"].dtype.kind == "U"
    source = TableSource.from_arrays(data, tmp_path / "data")
    indices = np.array([2, 0, 1, 1])
    _, remote = worker_read(source, indices)
    local = source.read_local(indices)
    assert remote[0]["words"].dtype == tf.string and remote[0]["words"].shape == (4, 2)
    np.testing.assert_array_equal(remote[0]["words"].numpy(), np.char.encode(words[indices], "utf-8"))
    np.testing.assert_array_equal(remote[0]["raw"].numpy(), raw[indices].astype(bytes))
    for got, want in zip(tf.nest.flatten(remote), tf.nest.flatten(local), strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert int(digest(remote)) == int(digest(local))


def test_train_arrays_text_files_any_byte_order(tmp_path):
    """The job's own .npy text files (np.save as the user writes them): memory-mapped UTF-32 and bytes,
    and a big-endian UTF-32 file read and decoded instead."""
    arrays = [np.array(["ab", "", "ünï"]), np.array(["ab", "", "ünï"]).astype(">U3"), np.array([b"x", b"\xff\x00", b""])]
    for i, array in enumerate(arrays):
        np.save(tmp_path / f"{i}.npy", array)
    source = TableSource.from_npy_paths(tuple(str(tmp_path / f"{i}.npy") for i in range(3)), "train_arrays()")
    _, remote = worker_read(source, [2, 0, 1])
    for got, array in zip(remote, arrays, strict=True):
        want = [x.encode() if isinstance(x, str) else x for x in array[[2, 0, 1]].tolist()]
        assert got.numpy().tolist() == want


def test_objects_that_are_not_text_are_refused_in_one_line(tmp_path):
    with pytest.raises(JobError, match=r"train_data\(\): an object array holds int, str; give text as str"):
        checked_arrays("job", "train_data", (np.array(["a", 1], dtype=object), np.zeros(2)))
    np.save(tmp_path / "o.npy", np.array(["a", "b"], dtype=object), allow_pickle=True)
    with pytest.raises(JobError, match=r"holds Python objects.*a.astype\(str\)"):
        NpyFile.read_header(str(tmp_path / "o.npy"), "train_arrays()")


def test_fortran_ordered_npy_is_refused_with_the_fix(tmp_path):
    np.save(tmp_path / "f.npy", np.asfortranarray(np.ones((3, 2), np.float32)))
    with pytest.raises(JobError, match="C-ordered .*np.ascontiguousarray"):
        NpyFile.read_header(str(tmp_path / "f.npy"), "train_arrays()")


def test_dataset_source_reads_positions_and_only_random_access_datasets_qualify():
    source = DatasetSource(lambda: tf.data.Dataset.range(10).map(lambda i: ({"x": tf.cast(i, tf.float32)}, i * 2)), "ds")
    (features, labels) = source.read_local(np.array([3, 9, 0]))
    np.testing.assert_array_equal(features["x"].numpy(), [3.0, 9.0, 0.0])
    np.testing.assert_array_equal(labels.numpy(), [6, 18, 0])
    streams = [  # read as streams (worker/input/streams.py)
        tf.data.Dataset.range(10).filter(lambda i: i > 2),  # unknown size
        tf.data.Dataset.range(10).repeat(),  # infinite
        tf.data.Dataset.range(10).enumerate(),  # a known size, but `at` does not work on it
        # `at` works on a shuffle, but a read by position starts a new iterator, which a reshuffle reorders.
        tf.data.Dataset.range(10).shuffle(10, seed=3).map(lambda i: i * 2),
        tf.data.Dataset.range(10).map(lambda i: tf.cast(i, tf.float32) + tf.random.uniform([], seed=1)),  # draws anew
    ]
    assert DatasetSource.random_access(tf.data.Dataset.range(10).map(lambda i: i * 2))
    assert not any(DatasetSource.random_access(d) for d in streams)


def test_a_map_holding_a_lookup_table_is_read_as_a_stream_and_sequences_made_by_batch_are_examples():
    """TF's `at` runs a map that captures a table with garbage return types on a worker: such a pipeline is
    a stream. A .batch() of single values made into examples afterwards (token sequences) is no batch."""
    import tf_keras

    lookup = tf_keras.layers.StringLookup(vocabulary=["a", "b"])
    table = tf.data.Dataset.from_tensor_slices(["a", "b", "c"]).map(lambda w: (lookup(w), 1))
    assert not DatasetSource.random_access(table)
    sequences = DatasetSource.made(load_job("tests.jobs.guides:TokenSequences").train_dataset, "ds")
    assert sequences.element_spec[0].shape.as_list() == [5]


def digits_dataset(transform):
    """A job's train_dataset(): digits examples through `transform`."""
    from chief.jobs import digits

    return lambda: transform(tf.data.Dataset.from_tensor_slices(digits.train_data()))


NOT_FIXED = [  # a job's pipeline that would train on other examples in each build of it: refused in one line
    (lambda d: d.shuffle(100), "two builds of the pipeline gave different first examples; its order must be fixed"),
    (  # a stream (random ops, like a shuffle, are not read by position)
        lambda d: d.map(lambda x, y: (x + tf.random.uniform(tf.shape(x), 0, 0.1), y)),
        "two builds of the pipeline gave different first examples; its order must be fixed",
    ),
    (  # batches a later map makes into another structure (weights added to whole batches): not taken apart
        lambda d: d.batch(32).map(lambda x, y: (x, y, tf.ones_like(y, tf.float32))),
        "its elements are batches (a .batch() of its examples: shape [None, 8, 8, 1]) that pstrain cannot take apart",
    ),
    (  # a batch of batches: taking the outer one apart would leave batches as examples
        lambda d: d.batch(4).batch(8),
        "its elements are batches (a .batch() of its examples: shape [None, None, 8, 8, 1]) that pstrain cannot take",
    ),
    (  # padded to each batch's longest example: taken apart, examples of one length would differ by batch
        lambda d: d.padded_batch(32),
        "its elements are batches (a .batch() of its examples: shape [None, 8, 8, 1]) that pstrain cannot take apart",
    ),
]


@pytest.mark.parametrize(
    "transform, message",
    NOT_FIXED,
    ids=["unseeded shuffle", "random map", "batches made into another structure", "batch of batches", "padded batch"],
)
def test_a_pipeline_whose_examples_are_not_fixed_is_refused(transform, message):
    from chief.contract.job import Job
    from chief.data.train_source import train_source

    job = Job("j", None, "mse", None, None, None, train_dataset=digits_dataset(transform))
    tf.random.set_seed(None)  # as where the chief makes the job's data (a global seed makes unseeded ops repeat)
    with pytest.raises(JobError) as raised:
        train_source(job, None, TrainConfig(job="j", global_batch_size=32, replicas_to_aggregate=2, total_num_replicas=2))
    assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


TAKEN_APART = [  # (a guide's pipeline of batches, examples in one pass: None where it repeats without end)
    (lambda d: d.batch(32), 1437),
    (lambda d: d.batch(32, drop_remainder=True).map(lambda x, y: (x * 2.0, y)).prefetch(2), 1437 // 32 * 32),
    (lambda d: d.shuffle(64, seed=3).batch(32).repeat(), None),
    (  # a map that drops rows of each batch: the count is not known before a pass
        lambda d: d.batch(32).map(lambda x, y: (tf.boolean_mask(x, y % 2 == 0), tf.boolean_mask(y, y % 2 == 0))),
        None,
    ),
]


@pytest.mark.parametrize(
    "transform, count", TAKEN_APART, ids=["batch", "drop_remainder, map, prefetch", "shuffle, repeat", "rows dropped"]
)
@pytest.mark.parametrize("global_batch", [32, 64])
def test_a_pipeline_of_batches_is_taken_apart_into_its_examples_in_its_order(capsys, transform, count, global_batch):
    """TF's guides end train_dataset() with .batch(32) (and .repeat(), .prefetch()): pstrain reads its
    examples, in the pipeline's order, and batches them itself; one console line where its batch differs."""
    from chief.contract.job import Job
    from chief.data.train_source import train_source
    from chief.epochs import pass_length
    from chief.jobs import digits

    job = Job("j", None, "mse", None, None, None, train_dataset=digits_dataset(transform))
    config = TrainConfig(job="j", global_batch_size=global_batch, replicas_to_aggregate=2, total_num_replicas=2)
    source = train_source(job, None, config)
    assert source.streams, "read in the pipeline's order, as Keras's fit reads a dataset"
    expected = transform(tf.data.Dataset.from_tensor_slices(digits.train_data())).unbatch().take(100).batch(100)
    for got, want in zip(source.first(100), expected.get_single_element(), strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    slot = global_batch // 2
    assert pass_length(source)[0] == (None if count is None else count // slot * slot)
    said = capsys.readouterr().out
    if global_batch == 32:
        assert "pstrain: warning" not in said, said
    else:
        assert said.count("\n") == 1 and said.startswith(
            "pstrain: warning: --job j: train_dataset() batches its examples (32 at a time): pstrain takes them one by "
            "one, in the pipeline's order, and batches them to train.global_batch_size = 64; give --global-batch-size 32"
        ), said


def test_a_seeded_shuffle_is_a_stream_whose_order_each_build_repeats():
    from chief.contract.job import Job
    from chief.data.train_source import train_source
    from worker.input.streams import StreamSource

    job = Job("j", None, "mse", None, None, None, train_dataset=digits_dataset(lambda d: d.shuffle(100, seed=3)))
    source = train_source(job, None, TrainConfig(job="j", global_batch_size=32, replicas_to_aggregate=2, total_num_replicas=2))
    assert isinstance(source, StreamSource)
    np.testing.assert_array_equal(source.first(8)[1].numpy(), source.first(8)[1].numpy())


class TwoSources:
    model_fn = loss_fn = optimizer_fn = staticmethod(lambda *a: None)
    train_data = train_dataset = staticmethod(lambda: None)


def test_a_job_gives_exactly_one_training_source():
    with pytest.raises(JobError, match="only one of train_dataset, train_data"):
        load_job("tests.worker.input.test_sources:TwoSources")


def test_a_run_dir_is_resumed_only_with_the_same_shuffle():
    previous = {"train": {"shuffle": "permutation", "seed": 0}}
    check_compatible(previous, TrainConfig(shuffle="permutation"))
    with pytest.raises(ConfigError, match="shuffle='permutation', not 'index_shuffle'"):
        check_compatible(previous, TrainConfig(shuffle="index_shuffle", run_dir="r"))
