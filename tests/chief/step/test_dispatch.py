"""The two engines against each other in one process: ClusterEngine runs its closures on real TF
servers started in the test process (2 workers, 2 ps, see conftest.py), LocalEngine is the
standalone reference. Fast enough to cover a matrix (optimizers) that whole launches could not."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tf_keras

from chief.contract.arrays import first_rows
from chief.contract.framework import variables_of
from chief.contract.job import Job, load_job
from chief.data.train_source import train_source
from chief.jobs import recommender
from chief.optimizers import LazyAdam
from chief.state.sharding import read_full, shard_groups
from chief.step.dispatch import ClusterEngine
from chief.step.local import LocalEngine
from cluster.config import TrainConfig
from cluster.rundir import RunDir

TABLES = recommender.small  # its user table is sharded over both ps (chief/state/sharding.py)

OPTIMIZERS = {
    "legacy SGD momentum": lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9),
    "legacy Adagrad": lambda: tf_keras.optimizers.legacy.Adagrad(0.1),
    "legacy Adam": lambda: tf_keras.optimizers.legacy.Adam(0.01),
    "legacy Ftrl": lambda: tf_keras.optimizers.legacy.Ftrl(0.1),
    "SGD momentum": lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9),
    "Adagrad": lambda: tf_keras.optimizers.Adagrad(0.1),
    "Adam": lambda: tf_keras.optimizers.Adam(0.01),
    "Ftrl": lambda: tf_keras.optimizers.Ftrl(0.1),
    "LazyAdam": lambda: LazyAdam(0.01),
}


def engine_inputs(job, train: TrainConfig, run_dir):
    """What the trainer hands an engine: the job's source (arrays written under `run_dir`) and one
    example's features."""
    return train_source(job, RunDir(run_dir)), first_rows(job.train_data()[0])


def run_both(resolver, job, steps: int, train: TrainConfig, run_dir, per_block: int = 3):
    """Both engines over `steps` steps, the cluster's in blocks of `per_block` (the last one shorter)."""
    source, sample = engine_inputs(job, train, run_dir)
    cluster = ClusterEngine(job, train, source, sample, resolver=resolver)
    cluster.prepare(0)
    local = LocalEngine(job, train, source, sample)
    local.prepare(0)
    blocks = [cluster.run(k, min(per_block, steps - k)) for k in range(0, steps, per_block)]
    results = list(zip([r for block in blocks for r in block], local.run(0, steps), strict=True))
    cluster.close()
    return cluster, local, results


def values(engine) -> list[np.ndarray]:
    """The values of a local engine's model variables."""
    return [v.numpy() for v in variables_of(engine.state.model.weights)]


def full_weights(engine, like: list[np.ndarray]) -> list[np.ndarray]:
    """The cluster model's variables read from the ps, shards joined to the shapes of `like`."""
    live = variables_of(engine.state.model.weights)
    shapes = [v.shape if v.shape.is_fully_defined() else v.read_value().shape for v in live]  # tf-idf weights: [None]
    groups = shard_groups(shapes, [w.shape for w in like])
    return [read_full([live[i] for i in group]).numpy() for group in groups]


@pytest.mark.inprocess
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sparse_tables_train_as_standalone_with_every_optimizer(in_process_cluster, name, tmp_path):
    job = dataclasses.replace(load_job("chief.jobs.recommender"), optimizer_fn=OPTIMIZERS[name])
    job = dataclasses.replace(job, model_fn=TABLES.model_fn, train_data=TABLES.train_data)
    train = TrainConfig(job="recommender", steps=4, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    cluster, local, results = run_both(in_process_cluster, job, 4, train, tmp_path)
    assert any("/part_1" in v.name for v in cluster.state.model.weights), "the user table is sharded over both ps"
    assert (sum(local.sparse), sum(cluster.sparse)) == (5, 6), "every table (each shard of one) is row-sparse, the MLP dense"
    np.testing.assert_allclose([c.loss for c, _ in results], [s.loss for _, s in results], atol=1e-6)
    reference = values(local)
    for got, want in zip(full_weights(cluster, reference), reference, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.inprocess
def test_backup_slots_with_sparse_tables_apply_exactly_n(in_process_cluster, tmp_path):
    job = dataclasses.replace(load_job("chief.jobs.recommender"), model_fn=TABLES.model_fn, train_data=TABLES.train_data)
    train = TrainConfig(job="recommender", steps=6, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=3)
    cluster = ClusterEngine(job, train, *engine_inputs(job, train, tmp_path), resolver=in_process_cluster)
    cluster.prepare(0)
    results = cluster.run(0, 4) + cluster.run(4, 2)
    dropped = sum(r.stale_dropped for r in results) + cluster.close()
    assert len(results) == 6 and all(r.aggregated == 2 and r.applied for r in results)
    assert dropped <= 6, "at most one surplus gradient per step, dropped (a backup that finds its step applied skips it)"
    assert int(cluster.state.global_step.numpy()) == 6


FROZEN_ROWS = 20_000  # a 20 000 x 8 float32 table (625 KiB) is split over both ps (chief/state/sharding.py)


def frozen_table_then_batchnorm() -> tf_keras.Model:
    """A frozen (non-trainable) embedding table before a BatchNormalization: the table's shards come
    before the moving statistics in the cluster model's non-trainable weights."""
    ids = tf_keras.Input(shape=(), dtype="int32")
    table = tf_keras.layers.Embedding(
        FROZEN_ROWS, 8, tf_keras.initializers.RandomNormal(stddev=1.0), trainable=False, name="frozen_table"
    )
    hidden = tf_keras.layers.Dense(16)(table(ids))
    hidden = tf_keras.layers.BatchNormalization(momentum=0.5)(hidden)  # moves visibly in a few steps
    return tf_keras.Model(ids, tf_keras.layers.Dense(2)(tf_keras.layers.ReLU()(hidden)))


def frozen_table_data() -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(3).integers(0, FROZEN_ROWS, 512).astype(np.int32)
    return ids, (ids % 2).astype(np.int32)


@pytest.mark.inprocess
def test_batchnorm_after_a_sharded_frozen_table_trains_as_standalone(in_process_cluster, tmp_path):
    """The moving statistics are found among the engine's own variables, whose shards shift the positions."""
    job = Job(
        "frozen_table",
        frozen_table_then_batchnorm,
        tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: tf_keras.optimizers.legacy.SGD(0.1),
        frozen_table_data,
        None,
    )
    train = TrainConfig(job="frozen_table", steps=4, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    cluster, local, results = run_both(in_process_cluster, job, 4, train, tmp_path)
    assert any("frozen_table" in v.name and "/part_1" in v.name for v in cluster.state.model.non_trainable_weights)
    captured = [v.name.split(":")[0].rsplit("/", 1)[-1] for v in cluster.replica.state_variables]
    assert captured == ["moving_mean", "moving_variance"]
    np.testing.assert_allclose([c.loss for c, _ in results], [s.loss for _, s in results], atol=1e-4)
    reference = values(local)
    bn = local.state.model.layers[3]
    assert np.abs(bn.moving_mean.numpy()).max() > 0.05 and np.abs(bn.moving_variance.numpy() - 1).max() > 0.05, "state moved"
    for got, want in zip(full_weights(cluster, reference), reference, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.inprocess
def test_text_features_through_lookup_layers_train_as_standalone(in_process_cluster, tmp_path):
    """String columns (written as fixed-width .npy, decoded on the workers) through StringLookup,
    TextVectorization, IntegerLookup and Hashing: each worker uses its own copy of the tables. In one
    block of 8 steps: a table gathered by ids looked up from the examples must be read after the gate
    (before the examples were tied to the gate's token, it was read early, one step stale)."""
    job = load_job("tests.jobs.data_jobs:lookup_layers")
    train = TrainConfig(job="lookup_layers", steps=8, global_batch_size=32, replicas_to_aggregate=2, total_num_replicas=2)
    cluster, local, results = run_both(in_process_cluster, job, 8, train, tmp_path, per_block=8)
    np.testing.assert_allclose([c.loss for c, _ in results], [s.loss for _, s in results], atol=1e-5)
    assert results[-1][1].loss < results[0][1].loss, "it learns"
    reference = values(local)
    for got, want in zip(full_weights(cluster, reference), reference, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.pure
def test_lazy_adam_moves_only_touched_rows():
    """Stock Adam keeps moving a row its momentum remembers; LazyAdam moves only the rows in the gradient."""
    import tensorflow as tf

    for optimizer, moved_in_second_step in ((tf_keras.optimizers.legacy.Adam(0.1), [1, 2]), (LazyAdam(0.1), [1])):
        table = tf.Variable(tf.ones([4, 2]))
        optimizer.apply_gradients([(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2]), tf.constant([4, 2])), table)])
        before = table.numpy()
        optimizer.apply_gradients([(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([1]), tf.constant([4, 2])), table)])
        moved = np.flatnonzero(np.any(table.numpy() != before, axis=1)).tolist()
        assert moved == moved_in_second_step, (type(optimizer).__name__, moved)


def masked_sqrt_model() -> tf_keras.Model:
    """The classic masked-branch NaN: where(x > 0, pow(x, 0.5), 0) has a finite value everywhere, but its
    gradient at x < 0 is 0 * NaN = NaN, so the loss stays finite while the mean gradient is not."""
    import tensorflow as tf

    inputs = tf_keras.Input((4,))
    x = tf_keras.layers.Dense(4, name="first")(inputs)
    x = tf_keras.layers.Lambda(lambda v: tf.where(v > 0, tf.pow(v, 0.5), tf.zeros_like(v)))(x)
    return tf_keras.Model(inputs, tf_keras.layers.Dense(1, name="out")(x))


def masked_sqrt_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((256, 4)).astype(np.float32), rng.standard_normal((256, 1)).astype(np.float32)


@pytest.mark.inprocess
# "allreduce": no table here, so the lean step (no ps on its path); it keeps only "stop" (test_hybrid_refusals.py)
@pytest.mark.parametrize(("mode", "dense"), [("stop", "ps"), ("skip", "ps"), ("stop", "allreduce")])
def test_a_nan_gradient_under_a_finite_loss_is_never_applied(in_process_cluster, tmp_path, mode, dense):
    job = Job(
        "masked_sqrt",
        masked_sqrt_model,
        tf_keras.losses.mean_squared_error,
        lambda: tf_keras.optimizers.legacy.SGD(0.1),
        masked_sqrt_data,
        None,
    )
    train = TrainConfig(job="masked_sqrt", steps=4, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    train = dataclasses.replace(train, on_nonfinite=mode, dense=dense)
    source, sample = engine_inputs(job, train, tmp_path)
    cluster = ClusterEngine(job, train, source, sample, resolver=in_process_cluster)
    cluster.prepare(0)
    assert cluster.lean == (dense == "allreduce")
    local = LocalEngine(job, train, source, sample)
    before = values(local)
    for engine in (cluster, local):
        results = engine.run(0, 4)
        assert not results[0].applied, "a withheld step"
        if engine is cluster and dense == "allreduce":  # one flag for all the lean step's means; its line says nan
            assert np.isnan(results[0].loss) and results[0].nonfinite == "loss", results[0]
        else:
            assert np.isfinite(results[0].loss) and results[0].nonfinite == "first/kernel", results[0]
        assert len(results) == (1 if mode == "stop" else 4), "stop ends the block at the bad step; skip goes on"
        assert int(engine.state.global_step.numpy()) == (0 if mode == "stop" else 4)
    if dense == "allreduce":  # the workers' copies onto the ps, checked to be still at step 0
        import tensorflow as tf

        cluster.coordinator.schedule(cluster.dense.write_back, args=(tf.constant(0, tf.int64),)).fetch()
    cluster.close()
    for got, want in zip(full_weights(cluster, before), before, strict=True):
        np.testing.assert_array_equal(got, want)  # every step was withheld: the weights (and copies) never moved
    for got in values(local):
        assert np.all(np.isfinite(got))


def while_bodies(graph) -> list:
    """The body graphs of the while loops made directly in `graph` (while_v2 keeps them on the op)."""
    return [op._body_graph for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]


def inner(graph, captured):
    """`graph`'s own placeholder for the outer tensor `captured`, or None where it does not capture it."""
    return next((internal for external, internal in graph.captures if external is captured), None)


@pytest.mark.inprocess
def test_the_lean_steps_loop_reads_nothing_on_the_ps(in_process_cluster, tmp_path):
    """The lean closure reads the chief's stop request in an outer loop, once per STOP_EVERY steps; the
    steps' own loop captures no handle of it. A ps variable read inside that loop would split it between
    the worker and the ps, which would trade its control every step. The stop still ends the block."""

    def model_fn() -> tf_keras.Model:
        inputs = tf_keras.Input((4,))
        return tf_keras.Model(inputs, tf_keras.layers.Dense(1)(tf_keras.layers.Dense(4)(inputs)))

    job = Job("dense", model_fn, tf_keras.losses.mean_squared_error, lambda: tf_keras.optimizers.SGD(0.1), masked_sqrt_data, None)
    train = TrainConfig(job="dense", steps=20, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    train = dataclasses.replace(train, dense="allreduce")
    source, sample = engine_inputs(job, train, tmp_path)
    cluster = ClusterEngine(job, train, source, sample, resolver=in_process_cluster)
    cluster.prepare(0)
    assert cluster.lean
    assert len(cluster.run(0, 1)) == 1
    traced = cluster._lean_fn._list_all_concrete_functions()
    assert len(traced) == train.total_num_replicas  # one trace per slot
    for function in traced:
        (chunks,) = while_bodies(function.graph)
        (steps,) = while_bodies(chunks)
        handle = cluster._stopping.handle  # a loop body captures an eager handle itself
        stop = inner(chunks, handle)
        assert stop is not None, "the outer loop reads the stop request"
        assert inner(steps, handle) is None and inner(steps, stop) is None, "the steps' loop does not"
    cluster._stopping.assign(True)
    assert cluster.run(1, 19) == [], "a stop request seen at the block's first step: no step applied"
    assert int(cluster.state.global_step.numpy()) == 1
    cluster.close()


@pytest.mark.inprocess
def test_blocks_of_any_length_give_the_same_model(in_process_cluster, tmp_path):
    """K = 1 (the chief on every step's path) and longer blocks train alike, with Dropout and BatchNorm;
    blocks of 1, 3 and 2 steps share one trace of the worker function per slot (no retrace per length)."""
    job = load_job("tests.jobs.keras_models:Mixed")
    train = TrainConfig(job="mixed", steps=6, global_batch_size=32, replicas_to_aggregate=2, total_num_replicas=2)
    ones = run_both(in_process_cluster, job, 6, train, tmp_path / "k1", per_block=1)
    fours = run_both(in_process_cluster, job, 6, train, tmp_path / "k4", per_block=4)
    for (_, _, results), per_block in ((ones, 1), (fours, 4)):
        np.testing.assert_allclose([c.loss for c, _ in results], [s.loss for _, s in results], atol=1e-6, err_msg=str(per_block))
    assert fours[0]._worker_fn.experimental_get_tracing_count() == train.total_num_replicas
    reference = values(ones[1])
    for cluster in (ones[0], fours[0]):
        for got, want in zip(full_weights(cluster, reference), reference, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.inprocess
def test_an_interrupt_ends_the_block_at_a_step_boundary(in_process_cluster, tmp_path):
    """A stop asked while a block runs: the apply stops before its next update; the steps returned are
    the steps applied, and the global step says the same."""
    job = dataclasses.replace(load_job("chief.jobs.recommender"), model_fn=TABLES.model_fn, train_data=TABLES.train_data)
    train = TrainConfig(job="recommender", steps=400, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    source, sample = engine_inputs(job, train, tmp_path)
    cluster = ClusterEngine(job, train, source, sample, resolver=in_process_cluster)
    cluster.prepare(0)
    cluster.run(0, 1)  # traced and warm

    def interrupted() -> bool:  # once a few steps of the block are applied, however loaded the machine
        return int(cluster.state.global_step.numpy()) >= 4

    results = cluster.run(1, 399, interrupted)
    assert 0 < len(results) < 399 and all(r.applied for r in results)
    assert int(cluster.state.global_step.numpy()) == 1 + len(results)


@pytest.mark.inprocess
def test_more_slots_than_workers_run_a_step_per_dispatch(in_process_cluster, tmp_path):
    """4 slots on 2 workers: a closure waiting at the gate would hold its worker while the slots it
    waits for are queued behind it, so such runs dispatch step by step, and still equal standalone."""
    job = dataclasses.replace(load_job("chief.jobs.recommender"), model_fn=TABLES.model_fn, train_data=TABLES.train_data)
    train = TrainConfig(job="recommender", steps=3, global_batch_size=64, replicas_to_aggregate=4, total_num_replicas=4)
    cluster, local, results = run_both(in_process_cluster, job, 3, train, tmp_path, per_block=3)
    assert [c.aggregated for c, _ in results] == [4, 4, 4]
    np.testing.assert_allclose([c.loss for c, _ in results], [s.loss for _, s in results], atol=1e-6)


@pytest.mark.inprocess
def test_a_table_gathered_by_looked_up_ids_is_read_after_the_gate(in_process_cluster, tmp_path):
    """chief.jobs.digits_text in one block of 8 steps: its embedding is gathered by ids a StringLookup
    makes from the examples. TF ties an op to a control dependency only when none of its inputs was made
    inside the block, so unless the examples themselves wait for the gate's token the gather ran early
    and read the table one step stale (losses off by ~1e-4 from step 1 or 2 on)."""
    job = load_job("chief.jobs.digits_text")
    train = TrainConfig(job="digits_text", steps=8, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    _, _, results = run_both(in_process_cluster, job, 8, train, tmp_path, per_block=8)
    np.testing.assert_array_equal([c.loss for c, _ in results], [s.loss for _, s in results])


@pytest.mark.inprocess
def test_a_long_run_equals_standalone_bit_for_bit(in_process_cluster, tmp_path):
    """1,024 steps of a BatchNorm CNN (with Dropout, random augmentation, L2 and Adam: the `Mixed` job)
    in blocks of 16: every loss and every weight, moving statistics included, equal to the standalone
    run's bit for bit. Before chief/step/rounding.py, grappler rewrote the step's sums differently in the
    two engines: the losses differed from step 7 on, the weights by up to 4e-7 at the end."""
    job = load_job("tests.jobs.keras_models:Mixed")
    steps = 1024
    train = TrainConfig(job="mixed", steps=steps, global_batch_size=16, replicas_to_aggregate=2, total_num_replicas=2)
    cluster, local, results = run_both(in_process_cluster, job, steps, train, tmp_path, per_block=16)
    assert [c.loss for c, _ in results] == [s.loss for _, s in results]
    assert results[-1][1].loss < 0.5 * results[0][1].loss, "it learns"
    reference, variables = values(local), variables_of(local.state.model.weights)
    for got, want, variable in zip(full_weights(cluster, reference), reference, variables, strict=True):
        assert np.array_equal(got, want), f"{variable.name}: differs by up to {np.abs(got - want).max():g}"


@pytest.mark.inprocess
def test_a_long_run_of_the_hybrid_step_equals_standalone_bit_for_bit(in_process_cluster, tmp_path):
    """The same long run with train.dense = "allreduce" (the `Mixed` job without the BatchNormalization
    the hybrid refuses; its L2 kernel regularizer read from the workers' copies): every loss, and every
    weight the workers' copies wrote back to the ps, equal to the standalone run's bit for bit."""
    job = load_job("tests.jobs.keras_models:MixedNoBN")
    steps = 1024
    train = TrainConfig(
        job="mixed", steps=steps, global_batch_size=16, replicas_to_aggregate=2, total_num_replicas=2, dense="allreduce"
    )
    cluster, local, results = run_both(in_process_cluster, job, steps, train, tmp_path, per_block=16)
    assert cluster.lean, "no table: the workers take each step with no ps on its path"
    assert [c.loss for c, _ in results] == [s.loss for _, s in results]
    assert results[-1][1].loss < 0.5 * results[0][1].loss, "it learns"
    reference, variables = values(local), variables_of(local.state.model.weights)
    for got, want, variable in zip(full_weights(cluster, reference), reference, variables, strict=True):
        assert np.array_equal(got, want), f"{variable.name}: differs by up to {np.abs(got - want).max():g}"


class SignFlip(tf_keras.layers.Layer):
    """A job's layer as users write them: a Python `if` on a tensor, which only AutoGraph can trace."""

    def call(self, x):
        if tf_keras.backend.sum(x) > 0:
            return x
        return -x


def branching_loss(y_true, y_pred):
    """A plain loss function with a Python `if` on a tensor."""
    import tensorflow as tf

    error = tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)
    if tf.reduce_mean(error) > 1e6:
        return error * 0.0
    return error


@pytest.mark.inprocess
def test_python_control_flow_in_a_jobs_layer_and_loss_trains_as_standalone(in_process_cluster, tmp_path):
    """The cluster engine traces its own loops with AutoGraph off (start-up); the job's layers and loss
    are still converted, as in Keras's fit, so their Python `if`s on tensors train, and equal standalone."""

    def model() -> tf_keras.Model:
        inputs = tf_keras.Input((4,))
        return tf_keras.Model(inputs, tf_keras.layers.Dense(1)(SignFlip()(tf_keras.layers.Dense(4)(inputs))))

    job = Job("branching", model, branching_loss, lambda: tf_keras.optimizers.legacy.SGD(0.1), masked_sqrt_data, None)
    train = TrainConfig(job="branching", steps=4, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)
    _, _, results = run_both(in_process_cluster, job, 4, train, tmp_path, per_block=4)
    assert len(results) == 4 and all(c.applied for c, _ in results)
    np.testing.assert_array_equal([c.loss for c, _ in results], [s.loss for _, s in results])
