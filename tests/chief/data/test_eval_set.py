"""Evaluation read in batches (chief/data/eval_set.py, chief/scores.py): the result does not
depend on the batch size, whatever the loss's reduction, with sample weights and uneven batches,
and an eval_dataset() gives the same figures as the same examples as arrays."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from chief.contract.job import Job, JobError
from chief.data.eval_set import EvalSet, eval_set
from chief.scores import evaluate

pytestmark = pytest.mark.pure


def model():
    tf_keras.utils.set_random_seed(3)
    net = tf_keras.Sequential([tf_keras.layers.Dense(4, kernel_regularizer=tf_keras.regularizers.L2(0.1))])
    net(np.zeros((1, 5), np.float32))
    return net


def data(n: int = 10):
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((n, 5)).astype(np.float32),
        rng.integers(0, 4, n).astype(np.int64),
        rng.uniform(0.5, 2.0, n).astype(np.float32),
    )


def job(loss_fn, eval_data=None, **eval_fns) -> Job:
    return Job("t", model, loss_fn, lambda: None, data, eval_data, **eval_fns)


@pytest.mark.parametrize(
    "loss_fn",
    [
        tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=tf_keras.losses.Reduction.SUM),
    ],
    ids=["mean", "sum"],
)
def test_the_eval_loss_does_not_depend_on_the_batch_size(loss_fn):
    net, arrays = model(), data()
    whole = evaluate(job(loss_fn), net, EvalSet.from_arrays(arrays, "x"), batch=1024)
    uneven = evaluate(job(loss_fn), net, EvalSet.from_arrays(arrays, "x"), batch=3)  # 3 + 3 + 3 + 1
    reference = float(loss_fn(arrays[1], net(arrays[0]), sample_weight=arrays[2])) + float(tf.add_n(net.losses))
    assert whole["eval_loss"] == pytest.approx(reference, rel=1e-5)
    assert uneven["eval_loss"] == pytest.approx(reference, rel=1e-5)
    predicted = np.argmax(net(arrays[0]).numpy(), axis=1)
    assert uneven["eval_accuracy"] == pytest.approx(np.mean(predicted == arrays[1]))


def test_an_eval_dataset_gives_the_same_figures_as_its_arrays():
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    net, arrays = model(), data(37)
    from_dataset = eval_set(job(loss_fn, eval_dataset=lambda: tf.data.Dataset.from_tensor_slices(arrays)), data)
    from_arrays = eval_set(job(loss_fn, eval_data=lambda: arrays), lambda n: None)
    assert evaluate(job(loss_fn), net, from_dataset, batch=8) == pytest.approx(evaluate(job(loss_fn), net, from_arrays, batch=8))


def test_without_an_eval_set_the_first_training_examples_are_used():
    asked = []
    fallback = eval_set(job("unused"), lambda n: asked.append(n) or data(5))
    assert asked == [8192] and sum(len(b[1]) for b in fallback.batches(2)) == 5


def test_an_eval_dataset_of_bare_features_is_refused_in_one_line():
    bad = job("unused", eval_dataset=lambda: tf.data.Dataset.from_tensor_slices(data()[0]))
    with pytest.raises(JobError, match=r"eval_dataset\(\): each element must be \(features, labels\)"):
        eval_set(bad, lambda n: None)


def test_an_eval_dataset_of_batches_is_taken_apart_into_its_examples():
    """A guide's `.batch(16)` (then a map of whole batches and a prefetch): pstrain evaluates its
    examples, in its order, in batches of its own size."""
    x, y, _ = data(37)
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(lambda f, label: (f * 2.0, label)).prefetch(2)
    batches = list(eval_set(job("unused", eval_dataset=lambda: pipeline), data).batches(10))
    assert [len(b[1]) for b in batches] == [10, 10, 10, 7]
    np.testing.assert_array_equal(np.concatenate([b[0] for b in batches]), x * 2.0)
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), y)


def test_an_eval_dataset_of_batches_it_cannot_take_apart_is_refused_before_training():
    """Batches that a later map makes into another structure (weights added to whole batches) stay batches."""
    x, y, _ = data(37)
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(lambda f, label: (f, label, tf.ones_like(f[:, 0])))
    with pytest.raises(JobError) as raised:
        eval_set(job("unused", eval_dataset=lambda: pipeline), data)  # data(1): one training example of 5 features
    assert str(raised.value) == (
        "--job t: eval_dataset(): its examples have shape [16, 5], the training examples [5]: it yields batches; "
        "give single examples, which pstrain batches (remove .batch())"
    )


def test_an_eval_dataset_that_repeats_without_end_is_refused_in_one_line():
    """TF's tutorial's eval set ends in .repeat().batch(8): taken apart it would never end."""
    x, y, _ = data(37)
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(16, seed=1).repeat().batch(8)
    with pytest.raises(JobError) as raised:
        eval_set(job("unused", eval_dataset=lambda: pipeline), data)
    assert str(raised.value) == (
        "--job t: eval_dataset() repeats without end; an evaluation reads the set once: remove its .repeat()"
    )
