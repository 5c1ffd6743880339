"""Gradient clipping as one process clips, with variables sharded over two ps.

With 2+ ps a large variable is a list of shards (chief/state/sharding.py); Keras's own clipping would
take each shard's norm. pstrain clips the step's mean gradient itself (worker/ps/clipping.py), per
whole variable, so the cluster run equals the standalone run whatever the number of ps.
"""

from __future__ import annotations

import numpy as np
import pytest
import tf_keras

from chief.contract.job import Job
from chief.step.local import LocalEngine
from cluster.config import TrainConfig
from tests.chief.step.test_dispatch import engine_inputs, full_weights, run_both
from worker.ps.clipping import SETTINGS, apply_clipped

ROWS, WIDTH = 20_000, 8  # a 625 KiB table: two shards
DENSE_IN = 256  # Dense(512) over 256 + 8 inputs: a 528 KiB kernel, two shards


def table_and_wide_dense(constraint=None) -> tf_keras.Model:
    """A row-sparse table and a dense kernel, each sharded over both ps."""
    ids = tf_keras.Input((4,), dtype="int32", name="ids")
    dense = tf_keras.Input((DENSE_IN,), name="dense")
    pooled = tf_keras.layers.GlobalAveragePooling1D()(tf_keras.layers.Embedding(ROWS, WIDTH, name="table")(ids))
    hidden = tf_keras.layers.Dense(512, activation="tanh", kernel_constraint=constraint, name="wide")(
        tf_keras.layers.Concatenate()([pooled, dense])
    )
    return tf_keras.Model({"ids": ids, "dense": dense}, tf_keras.layers.Dense(1, name="out")(hidden))


def clipping_data(n: int = 512):
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 300, size=(n, 4)).astype(np.int32)  # few rows: rows repeat within and across slots
    dense = rng.normal(size=(n, DENSE_IN)).astype(np.float32)
    y = (3.0 * dense[:, :1] + np.sin(ids[:, :1] / 7.0)).astype(np.float32)
    return {"ids": ids, "dense": dense}, y


CLIPPED = {
    "legacy clipnorm": lambda: tf_keras.optimizers.legacy.SGD(0.5, clipnorm=0.1),
    "legacy global_clipnorm": lambda: tf_keras.optimizers.legacy.SGD(0.5, global_clipnorm=0.1),
    "legacy clipvalue": lambda: tf_keras.optimizers.legacy.SGD(0.5, clipvalue=0.002),
    "legacy clipvalue+clipnorm": lambda: tf_keras.optimizers.legacy.Adam(0.01, clipvalue=0.01, clipnorm=0.1),
    "clipnorm": lambda: tf_keras.optimizers.SGD(0.5, clipnorm=0.1),
    "global_clipnorm": lambda: tf_keras.optimizers.SGD(0.5, global_clipnorm=0.1),
    "clipvalue": lambda: tf_keras.optimizers.Adam(0.01, clipvalue=0.002),
    "AdamW global_clipnorm": lambda: tf_keras.optimizers.AdamW(0.01, weight_decay=0.5, global_clipnorm=0.1),
}


def unclipped(optimizer):
    """The same optimizer without its clip settings."""
    config = {k: v for k, v in optimizer.get_config().items() if k not in SETTINGS}
    return type(optimizer).from_config(config)


def clipping_job(optimizer_fn) -> Job:
    return Job("clipping", table_and_wide_dense, tf_keras.losses.mean_squared_error, optimizer_fn, clipping_data, None)


TRAIN = TrainConfig(job="clipping", steps=3, global_batch_size=64, replicas_to_aggregate=2, total_num_replicas=2)


@pytest.mark.inprocess
@pytest.mark.parametrize("name", CLIPPED)
def test_clipping_with_variables_sharded_over_two_ps_equals_standalone(in_process_cluster, name, tmp_path):
    cluster, local, _ = run_both(in_process_cluster, clipping_job(CLIPPED[name]), 3, TRAIN, tmp_path / "clipped")
    names = [v.name for v in cluster.state.model.trainable_variables]
    assert any("table" in n and "/part_1" in n for n in names) and any("wide" in n and "/part_1" in n for n in names)
    reference = local.state.model.get_weights()
    for got, want in zip(full_weights(cluster, reference), reference, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    job = clipping_job(lambda: unclipped(CLIPPED[name]()))
    plain = LocalEngine(job, TRAIN, *engine_inputs(job, TRAIN, tmp_path / "plain"))
    plain.run(0, 3)
    moved = max(np.abs(a - b).max() for a, b in zip(plain.state.model.get_weights(), reference, strict=True))
    assert moved > 1e-3, "the clipping changed the model"


def keras_and_pstrain(make_optimizer, grads):
    """Variables after two applies of `grads` (then 10 x `grads`) by the optimizer's own clipping, and by pstrain's."""
    import tensorflow as tf

    results = []
    for ours in (False, True):
        variables = [tf.Variable(tf.ones([6, 3])), tf.Variable(tf.ones([4])), tf.Variable(tf.ones([5, 2]))]
        optimizer = make_optimizer()
        for scale in (1.0, 10.0):  # two steps: Adam's first step hardly depends on the gradient's size
            scaled = [
                g * scale if not isinstance(g, tf.IndexedSlices) else tf.IndexedSlices(g.values * scale, g.indices, g.dense_shape)
                for g in grads
            ]
            if ours:
                apply_clipped(optimizer, scaled, variables)
            else:
                optimizer.apply_gradients(zip(scaled, variables, strict=True))
        results.append([v.numpy() for v in variables])
    return results


@pytest.mark.pure
@pytest.mark.parametrize("name", CLIPPED)
def test_clipping_is_the_optimizers_own_on_whole_variables(name):
    """Dense gradients and row slices (each row once): pstrain's clipping, then the optimizer with its
    own switched off, gives exactly what the optimizer gives when it clips."""
    import tensorflow as tf

    rng = np.random.default_rng(1)
    grads = [
        tf.constant(rng.normal(size=(6, 3)), tf.float32),
        tf.constant(rng.normal(size=4) * 0.001, tf.float32),
        tf.IndexedSlices(tf.constant(rng.normal(size=(2, 2)), tf.float32), tf.constant([3, 1]), tf.constant([5, 2])),
    ]
    keras, ours = keras_and_pstrain(CLIPPED[name], grads)
    plain, _ = keras_and_pstrain(lambda: unclipped(CLIPPED[name]()), grads)
    for a, b in zip(keras, ours, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert max(np.abs(a - b).max() for a, b in zip(keras, plain, strict=True)) > 1e-3, "the clipping mattered"


@pytest.mark.pure
def test_clipvalue_under_loss_scaling_still_skips_an_overflowed_step():
    """Keras's LossScaleOptimizer checks the gradients before its inner optimizer clips them: an
    infinite gradient skips the step (and halves the scale); clipped first, it would be applied."""
    import tensorflow as tf

    variable = tf.Variable(tf.ones([3]))
    optimizer = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.legacy.SGD(1.0, clipvalue=0.5))
    scale = float(optimizer.loss_scale)
    apply_clipped(optimizer, [tf.constant([np.inf, 1.0, 1.0])], [variable])
    np.testing.assert_array_equal(variable.numpy(), [1.0, 1.0, 1.0])
    assert float(optimizer.loss_scale) == scale / 2
    apply_clipped(optimizer, [tf.constant([3.0, 0.2, -1.0])], [variable])
    np.testing.assert_allclose(variable.numpy(), [0.5, 0.8, 1.5])


REFUSED = {
    "use_ema": (
        lambda: tf_keras.optimizers.Adam(0.01, use_ema=True),
        None,
        "optimizer_fn: use_ema=True is not supported",
    ),
    "constraint on a sharded kernel": (
        lambda: tf_keras.optimizers.SGD(0.1),
        tf_keras.constraints.MaxNorm(1.0),
        "model_fn: wide/kernel has a MaxNorm constraint and is split across ps tasks",
    ),
}


@pytest.mark.inprocess
@pytest.mark.parametrize("name", REFUSED)
def test_whole_variable_features_that_cannot_be_exact_are_refused(in_process_cluster, name, tmp_path):
    from chief.contract.job import JobError
    from chief.step.dispatch import ClusterEngine

    optimizer_fn, constraint, message = REFUSED[name]

    job = Job(
        "clipping",
        lambda: table_and_wide_dense(constraint),
        tf_keras.losses.mean_squared_error,
        optimizer_fn,
        clipping_data,
        None,
    )
    with pytest.raises(JobError, match=f"^{message}") as raised:
        ClusterEngine(job, TRAIN, *engine_inputs(job, TRAIN, tmp_path), resolver=in_process_cluster)
    assert "\n" not in str(raised.value)


@pytest.mark.pure
@pytest.mark.parametrize("setting", [{"clipnorm": 1.0}, {"clipvalue": 0.3}, {"global_clipnorm": 1.0}])
def test_row_slices_with_repeated_rows_are_clipped_as_their_dense_sum(setting):
    """A step's mean joins the slots' rows, so a row two slots touched comes twice: it is clipped as
    the dense mean gradient is (the repeated rows summed first), whatever the slots' split."""
    import tensorflow as tf

    from worker.ps.clipping import Clipping, clip

    variable = tf.Variable(tf.zeros([4, 2]))
    rows = tf.IndexedSlices(tf.constant([[0.4, 0.2], [0.5, -0.3], [0.4, 0.6]]), tf.constant([2, 0, 2]), tf.constant([4, 2]))
    clipping = Clipping(**setting)
    (sparse,) = clip(clipping, [rows], [variable])
    (dense,) = clip(clipping, [tf.convert_to_tensor(rows)], [variable])
    np.testing.assert_allclose(tf.convert_to_tensor(sparse).numpy(), dense.numpy(), rtol=1e-6)
    assert sorted(sparse.indices.numpy().tolist()) == [0, 2]
