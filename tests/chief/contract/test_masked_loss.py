"""An output that carries a Keras mask (`Embedding(mask_zero=True)`) is trained and scored as fit and
evaluate reduce it, in tf_keras and Keras 3: one pstrain step equals one step of `model.fit` (a mean over the
unmasked positions with one slot; a masked SUM split over two slots), the eval loss equals `evaluate`
over the whole set in one batch (its accuracy too), and a mean that two slots cannot split exactly is refused in one
line when the step is traced (before any step). In process (no cluster)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from chief.contract.arrays import rows
from chief.contract.framework import trainable_of
from chief.contract.job import JobError, load_job
from chief.data.eval_set import EvalSet
from chief.scores import evaluate
from chief.state.model_state import create_optimizer_slots
from tests.jobs import masked
from worker.ps.clipping import apply_clipped
from worker.replica.replica import Replica, replica_step, run_unwrapped

pytestmark = pytest.mark.pure


def seeded() -> None:
    tf_keras.utils.set_random_seed(1)
    keras.utils.set_random_seed(1)


def fitted(name: str, data: tuple) -> tuple[tf_keras.Model, float]:
    seeded()
    model = getattr(masked, name).model_fn()
    sample_weight = data[2] if len(data) > 2 else None
    history = model.fit(data[0], data[1], sample_weight=sample_weight, batch_size=len(data[0]), shuffle=False, verbose=0)
    return model, history.history["loss"][0]


@pytest.mark.parametrize(
    "name, slots", [("Masked", 1), ("MaskedWeighted", 1), ("MaskedSum", 2), ("Keras3Masked", 1), ("Keras3MaskedSum", 2)]
)
def test_one_step_equals_tf_keras_fit(name, slots):
    """Without the mask the loss was 1.110 against fit's 1.095 (Masked) and the weights 0.16 apart."""
    job = load_job(f"tests.jobs.masked:{name}")
    data = rows(getattr(masked, name).train_data(), slice(0, 16))
    assert np.count_nonzero(data[0] == 0) > 0  # padding the mask leaves out
    theirs, fit_loss = fitted(name, data)

    seeded()
    model, optimizer = job.model_fn(), job.optimizer_fn()
    before = [v.numpy() for v in model.weights]
    create_optimizer_slots(optimizer, model.trainable_variables)
    replica = Replica(job, model, optimizer, (), seed=0, num_slots=slots)
    n, losses, grads = 16 // slots, [], []
    for k in range(slots):
        loss, slot_grads, _ = replica_step(replica, rows(data, slice(n * k, n * k + n)), tf.constant(0, tf.int64), k)
        losses.append(float(loss))
        grads.append(slot_grads)
    apply_clipped(optimizer, [sum(g) / slots for g in zip(*grads, strict=True)], trainable_of(model))
    assert np.mean(losses) == pytest.approx(fit_loss, rel=1e-6)
    for ours, fit_weight, start in zip(model.weights, theirs.weights, before, strict=True):
        np.testing.assert_allclose(ours.numpy(), fit_weight.numpy(), atol=1e-6)
        assert not np.array_equal(ours.numpy(), start), "the step moved every weight"


@pytest.mark.parametrize("name", ["Masked", "MaskedWeighted", "Keras3Masked"])
def test_a_masked_mean_over_two_slots_is_refused_when_the_step_is_traced(name):
    job = load_job(f"tests.jobs.masked:{name}")
    replica = Replica(job, job.model_fn(), job.optimizer_fn(), (), seed=0, num_slots=2)
    step = tf.function(lambda d: replica_step(replica, d, tf.constant(0, tf.int64), 0)[0], autograph=False)
    with pytest.raises(JobError) as raised:
        run_unwrapped(step, rows(getattr(masked, name).train_data(), slice(0, 8)))
    text = str(raised.value)
    assert text.startswith("model_fn's compile(loss=...): the model's output carries a Keras mask") and "\n" not in text
    assert "2 replica slots cannot split exactly; use a loss with reduction=SUM, or --replicas-to-aggregate 1" in text


@pytest.mark.parametrize("name", ["Masked", "MaskedSum", "Keras3Masked"])
def test_eval_loss_equals_evaluate_over_the_whole_set(name):
    """Read 5 examples at a time, the masked mean is still over the whole set's unmasked positions."""
    job = load_job(f"tests.jobs.masked:{name}")
    seeded()
    model = job.model_fn()
    data = masked.Masked.eval_data()
    expected, accuracy = model.evaluate(*data, batch_size=len(data[0]), verbose=0)
    by_batch, _ = model.evaluate(*data, batch_size=5, verbose=0)
    ours = evaluate(job, model, EvalSet.from_arrays(data, "eval_data()"), batch=5)
    assert ours["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert ours["eval_accuracy"] == pytest.approx(accuracy, rel=1e-6)  # over the unmasked positions too
    if name != "MaskedSum":
        assert abs(by_batch - expected) > 1e-4  # the check can fail: per-batch means weigh positions differently
