"""TensorBoard event files written from metrics.jsonl's records, read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import tensorflow  # noqa: F401 - TensorBoard's writer imports it lazily; here, not inside a pure test (it runs `uname`)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from chief.metrics import MetricsLog
from chief.tensorboard import eval_scalars, train_scalars
from cluster.rundir import RunDir

pytestmark = pytest.mark.pure


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard loads them (every event file in the folder, in order)."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def step_record(step: int, loss: float, workers=(0, 1)) -> dict:
    return {
        "step": step,
        "loss": loss,
        "aggregated": len(workers),
        "stale_dropped": 0,
        "workers": list(workers),
        "seconds": 0.05,
        "time": 1796240000.0 + step,
        "timing": {"dispatch": 0.01, "steps": 0.02},
    }


def test_train_scalars_derive_rates_phases_and_gradient_counts():
    scalars = train_scalars(step_record(3, 0.5), examples_per_step=64, gradients={0: 4, 1: 3})
    assert scalars["loss"] == 0.5 and scalars["seconds"] == 0.05 and scalars["aggregated"] == 2
    assert abs(scalars["steps_per_second"] - 20.0) < 1e-9 and abs(scalars["examples_per_second"] - 1280.0) < 1e-6
    assert scalars["timing/steps"] == 0.02 and scalars["stale_dropped"] == 0
    assert scalars["gradients_applied/worker_0"] == 4 and scalars["gradients_applied/worker_1"] == 3
    assert "step" not in scalars and "time" not in scalars and "workers" not in scalars


def test_eval_scalars_take_any_numeric_field_of_eval_and_done_records():
    assert eval_scalars({"event": "eval", "step": 10, "loss": 0.3, "accuracy": 0.9, "note": "x"}) == {
        "loss": 0.3,
        "accuracy": 0.9,
    }
    done = {"event": "done", "steps": 20, "eval_loss": 0.2, "eval_accuracy": 0.95, "wall_seconds": 3.0}
    assert eval_scalars(done) == {"loss": 0.2, "accuracy": 0.95}


def test_resume_leaves_one_curve_with_the_new_values(tmp_path):
    """Steps 0..19 written, then a resume from step 10 rewrites 10..14: TensorBoard sees 0..14 once each."""
    path = tmp_path / "metrics.jsonl"
    first = MetricsLog(RunDir(path.parent), resume_step=0, examples_per_step=64)
    for step in range(20):
        first.write(step_record(step, loss=1.0))
    first.write({"event": "eval", "step": 20, "loss": 0.9, "accuracy": 0.5})
    first.close()
    second = MetricsLog(RunDir(path.parent), resume_step=10, examples_per_step=64)
    for step in range(10, 15):
        second.write(step_record(step, loss=2.0, workers=(1,)))
    second.write({"event": "done", "steps": 15, "eval_loss": 0.4, "eval_accuracy": 0.8, "wall_seconds": 1.0})
    second.close()

    train = read_scalars(tmp_path / "tensorboard" / "train")
    assert [s for s, _ in train["loss"]] == list(range(15))
    assert [v for _, v in train["loss"]] == [1.0] * 10 + [2.0] * 5
    # Counts continue from the kept history: worker 0 stays at its 10, worker 1 goes on to 15.
    assert train["gradients_applied/worker_0"][-1] == (14, 10.0)
    assert train["gradients_applied/worker_1"][-1] == (14, 15.0)
    assert set(train) >= {"examples_per_second", "steps_per_second", "timing/steps", "aggregated", "stale_dropped"}
    evals = read_scalars(tmp_path / "tensorboard" / "eval")
    assert evals["loss"] == [(15, 0.4000000059604645)] and evals["accuracy"] == [(15, 0.800000011920929)]


def test_learning_rate_of_fixed_rates_and_schedules():
    import tf_keras

    from chief.metrics import learning_rate_fn

    assert learning_rate_fn(tf_keras.optimizers.legacy.SGD(0.25))(7) == 0.25
    schedule = tf_keras.optimizers.schedules.ExponentialDecay(1.0, decay_steps=10, decay_rate=0.5)
    rate = learning_rate_fn(tf_keras.optimizers.legacy.Adam(schedule))
    assert rate(0) == 1.0 and abs(rate(10) - 0.5) < 1e-6
    assert learning_rate_fn(object())(3) is None


def test_learning_rate_joins_the_step_record(tmp_path):
    log = MetricsLog(RunDir(tmp_path), 0, examples_per_step=64, learning_rate=lambda step: 0.1 / (step + 1))
    for step in range(3):
        log.write(step_record(step, 1.0))
    log.close()
    assert [round(v, 6) for _, v in read_scalars(tmp_path / "tensorboard" / "train")["learning_rate"]] == [0.1, 0.05, 0.033333]


def test_a_tail_cut_short_by_a_crash_is_dropped_on_resume(tmp_path):
    from chief.tensorboard import read_events

    path = tmp_path / "metrics.jsonl"
    first = MetricsLog(RunDir(path.parent), resume_step=0, examples_per_step=64)
    for step in range(6):
        first.write(step_record(step, loss=1.0))
    first.close()
    (events_file,) = (tmp_path / "tensorboard" / "train").glob("events.out.tfevents.*")
    events_file.write_bytes(events_file.read_bytes()[:-7])  # the last record half written
    assert read_events(events_file.read_bytes())[1] is False
    MetricsLog(RunDir(path.parent), resume_step=4, examples_per_step=64).close()
    events, clean = read_events(events_file.read_bytes())
    assert clean and sorted({e.step for e in events if e.HasField("summary")}) == [0, 1, 2, 3]


def test_flush_puts_every_step_on_disk_while_the_run_goes_on(tmp_path):
    """What the trainer calls at each checkpoint: the events so far are readable before close()."""
    log = MetricsLog(RunDir(tmp_path), 0, examples_per_step=64)
    for step in range(5):
        log.write(step_record(step, 1.0))
    log.flush()
    assert [s for s, _ in read_scalars(tmp_path / "tensorboard" / "train")["loss"]] == [0, 1, 2, 3, 4]
    log.close()
