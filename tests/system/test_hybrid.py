"""The hybrid step (train.dense = "allreduce") on a real local cluster, against the standalone reference."""

from __future__ import annotations

import re
import signal

import numpy as np
import pytest

from chief.step.hybrid import COPIES_PAST
from tests.helpers import assert_no_orphans, kill_task_when, metrics, predictions, run_pstrain
from tests.jobs import hybrid
from tests.soak import compare_checkpoints

pytestmark = pytest.mark.cluster

STEPS = 30


def standalone(tmp_path, job: str, steps: int = STEPS):
    reference = tmp_path / "standalone"
    result = run_pstrain(["train", "--standalone", "--job", job, "--steps", str(steps), "--run-dir", str(reference)])
    assert result.returncode == 0, result.output
    return reference


LEAN = "the workers take each step with no ps on its path"  # the chief's log line (chief/step/dispatch.py)


def took_no_ps_path(run_dir) -> bool:
    """Whether the run's chief took the hybrid steps with no ps on their path (a model with no table)."""
    return LEAN in (run_dir / "logs" / "chief-0.log").read_text()


def assert_same_run(run_dir, reference, features) -> None:
    """The final checkpoint (model, optimizer slots and step count), every step's loss and the exported
    model's predictions are those of the standalone run, bit for bit."""
    largest, different = compare_checkpoints(run_dir, reference)
    assert different == [] and largest == 0.0, (largest, different)
    assert [s["loss"] for s in metrics(run_dir)[0]] == [s["loss"] for s in metrics(reference)[0]]
    np.testing.assert_array_equal(predictions(run_dir, features), predictions(reference, features))


@pytest.mark.parametrize(
    ("job", "flags"),
    [
        ("adam", []),
        ("momentum", ["--ps", "2", "--steps-per-execution", "1"]),
        ("legacy", []),
        ("legacy_sgd", ["--ps", "2", "--steps-per-execution", "1"]),
        ("lazy_adam", []),
        ("dense_adam", []),
        ("dense_legacy_sgd", ["--steps-per-execution", "1"]),
        ("regularized", []),
        ("regularized_legacy", ["--steps-per-execution", "1"]),
        ("regularized_dense", []),
    ],
    ids=[
        "adam-default-K",
        "momentum-2ps-K1",
        "legacy-adam-default-K",
        "legacy-sgd-2ps-K1",
        "lazy-adam-default-K",
        "dense-only-adam-default-K",
        "dense-only-legacy-sgd-K1",
        "weight-regularizers-default-K",
        "weight-regularizers-legacy-adam-K1",
        "dense-only-weight-regularizer-default-K",
    ],
)
def test_two_worker_allreduce_run_equals_standalone_bit_for_bit(tmp_path, job, flags):
    """The tower's gradients exchanged among 2 workers, the tables on the ps: the same model as one process.
    A model with no table ("dense-only") takes steps with no ps on their path: the same model too."""
    name = f"tests.jobs.hybrid:{job}"
    run_dir = tmp_path / "run"
    result = run_pstrain(
        ["launch", "--job", name, "--dense", "allreduce", "--steps", str(STEPS), "--run-dir", str(run_dir), *flags]
    )
    assert result.returncode == 0, result.output
    assert took_no_ps_path(run_dir) == job.startswith("dense_") or job == "regularized_dense"
    assert_same_run(run_dir, standalone(tmp_path, name), hybrid.adam.eval_data()[0])
    assert_no_orphans(result)


@pytest.mark.parametrize("job", ["scheduled", "scheduled_dense_legacy"])
def test_a_learning_rate_set_by_a_callback_reaches_the_workers_copies(tmp_path, job):
    """Keras's LearningRateScheduler halves the rate from epoch 2 on the chief's optimizer (new-style
    Adam; legacy Adam); the workers' copies of the tower update with it (they once kept the first rate:
    a different model, no error). The dense-only model's workers read it once a block."""
    name, run_dir, reference = f"tests.jobs.hybrid:{job}", tmp_path / "run", tmp_path / "standalone"
    result = run_pstrain(["launch", "--job", name, "--dense", "allreduce", "--epochs", "2", "--run-dir", str(run_dir)])
    assert result.returncode == 0, result.output
    alone = run_pstrain(["train", "--standalone", "--job", name, "--epochs", "2", "--run-dir", str(reference)])
    assert alone.returncode == 0, alone.output
    assert_same_run(run_dir, reference, hybrid.adam.eval_data()[0])
    assert metrics(run_dir)[0][-1]["learning_rate"] == pytest.approx(0.005)


def test_a_run_resumes_across_dense_modes_to_the_standalone_model(tmp_path):
    """Checkpoints hold one full-size copy of the dense variables and their optimizer state, as "ps"
    does: 10 steps with "ps", 10 more with "allreduce", 10 more with "ps" end where one process ends."""
    name, run_dir = "tests.jobs.hybrid:adam", tmp_path / "run"
    for steps, dense in ((10, "ps"), (20, "allreduce"), (30, "ps")):
        result = run_pstrain(["launch", "--job", name, "--dense", dense, "--steps", str(steps), "--run-dir", str(run_dir)])
        assert result.returncode == 0, result.output
    largest, different = compare_checkpoints(run_dir, standalone(tmp_path, name))
    assert different == [] and largest == 0.0, (largest, different)


@pytest.mark.parametrize(
    ("job", "task", "sig", "flags"),
    [
        ("adam", "worker", signal.SIGKILL, []),
        ("dense_adam", "worker", signal.SIGKILL, []),
        ("dense_adam", "worker", signal.SIGKILL, ["--steps-per-execution", "1"]),
        ("adam", "worker", signal.SIGSTOP, []),
        ("dense_adam", "worker", signal.SIGSTOP, ["--steps-per-execution", "1"]),
        ("adam", "ps", signal.SIGKILL, []),
        ("adam", "ps", signal.SIGKILL, ["--steps-per-execution", "1"]),
    ],
    ids=["killed", "killed-dense-only", "killed-K1-dense-only", "hung", "hung-K1-dense-only", "ps-killed", "ps-killed-K1"],
)
def test_a_lost_task_restarts_every_worker_and_the_run_ends_with_the_standalone_model(tmp_path, job, task, sig, flags):
    """Each fault at the default K and at K = 1. A worker killed (or hung) mid-run aborts the survivors'
    collectives for good (../shared/notes/hybrid.md): the launcher restarts every worker, then the chief,
    which resumes from the last checkpoint with a fresh collective group; the run ends with the
    standalone model, no error line, every process reaped. A killed ps (its variables lost) restarts
    with them. A model with no table ("dense-only": no ps on a step's path) finds a hung worker by its
    block running too long."""
    name, run_dir, killed = f"tests.jobs.hybrid:{job}", tmp_path / "run", []
    args = ["launch", "--job", name, "--dense", "allreduce", "--steps", "120", "--checkpoint-every", "25"]
    args += ["--run-dir", str(run_dir), *flags]
    victim = 1 if task == "worker" else 0
    result = run_pstrain(args, signal_when=kill_task_when(run_dir, task, victim, 40, killed, sig), send=None, timeout=400)
    assert killed
    assert result.returncode == 0, result.output
    warned = [line for line in result.output.splitlines() if "restarting every worker and the chief" in line]
    # named by the launcher when it saw the task go, else (a worker) the chief saw the collectives fail first
    named = ("lost ps-0",) if task == "ps" else ("lost worker-1", "the chief saw the workers' collectives fail")
    assert len(warned) == 1 and any(n in warned[0] for n in named) and "from checkpoint step " in warned[0], result.output
    assert "pstrain: error:" not in result.output and "Traceback" not in result.output, result.output
    largest, different = compare_checkpoints(run_dir, standalone(tmp_path, name, steps=120))
    assert different == [] and largest == 0.0, (largest, different)
    assert [r["step"] for r in metrics(run_dir)[0]] == list(range(120))
    assert_no_orphans(result)


@pytest.mark.parametrize("job", ["adam", "dense_adam"], ids=["tables", "dense-only"])
def test_a_killed_chief_resumes_on_two_ps_to_the_standalone_model(tmp_path, job):
    """The chief killed mid-run (the launch ends with it, every task reaped); the same command with
    --ps 2 resumes from the last checkpoint (the workers' copies start again from the ps's values, which
    the checkpoint held) and ends with the standalone model, bit for bit."""
    name, run_dir, killed, steps = f"tests.jobs.hybrid:{job}", tmp_path / "run", [], 80
    args = ["launch", "--job", name, "--dense", "allreduce", "--steps", str(steps), "--checkpoint-every", "20"]
    args += ["--run-dir", str(run_dir)]
    first = run_pstrain(args, signal_when=kill_task_when(run_dir, "chief", 0, 30, killed), send=None)
    assert killed
    assert first.returncode == 128 + signal.SIGKILL, first.output
    assert_no_orphans(first)
    second = run_pstrain([*args, "--ps", "2"])
    assert second.returncode == 0, second.output
    resumed_at = int(re.search(rf"steps (\d+)\.\.{steps}", second.output).group(1))
    assert resumed_at >= 20 and resumed_at % 20 == 0, "resumed from the last checkpoint before the kill"
    assert took_no_ps_path(run_dir) == (job == "dense_adam")
    largest, different = compare_checkpoints(run_dir, standalone(tmp_path, name, steps=steps))
    assert different == [] and largest == 0.0, (largest, different)
    assert_no_orphans(second)


def test_a_refused_setting_stops_the_launch_in_one_line_before_any_step(tmp_path):
    """Backup workers with "allreduce": one line naming train.dense and the fix, exit 2, no step, no process left."""
    run_dir = tmp_path / "run"
    args = ["launch", "--job", "tests.jobs.hybrid:adam", "--dense", "allreduce", "--steps", "5", "--run-dir", str(run_dir)]
    result = run_pstrain([*args, "--total-num-replicas", "3"])
    assert result.returncode == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("pstrain: error:")]
    assert len(errors) == 1 and "backup workers" in errors[0] and 'train.dense = "ps"' in errors[0], result.output
    assert "Traceback" not in result.output and not metrics(run_dir)[0]
    assert_no_orphans(result)


def test_a_loss_that_holds_a_replicated_variable_is_refused_in_one_line_before_any_step(tmp_path):
    """`add_loss(lambda: ... kernel ...)` reads the ps's variable, not the worker's copy: the hybrid could
    not keep it exact, so the launch stops in one line naming the variable and the fix."""
    run_dir = tmp_path / "run"
    result = run_pstrain(
        ["launch", "--job", "tests.jobs.hybrid:held_loss", "--dense", "allreduce", "--steps", "5", "--run-dir", str(run_dir)]
    )
    assert result.returncode == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("pstrain: error:")]
    assert len(errors) == 1 and "other than through its layer" in errors[0] and 'train.dense = "ps"' in errors[0], result.output
    assert "Traceback" not in result.output and not metrics(run_dir)[0]
    assert_no_orphans(result)


@pytest.mark.parametrize("job", ["adam", "dense_adam"], ids=["tables", "dense-only"])
def test_a_stop_mid_block_applies_the_step_nowhere_or_everywhere_and_resumes_exactly(tmp_path, job):
    """SIGTERM while a block of K = 64 runs: the ps ends it at a step boundary, the workers update their
    copies only for steps the ps applied, the checkpoint holds them, and the same command resumes to
    the standalone model bit for bit. With no table the workers end the block together, at the step
    where one of them read the stop request."""
    name, steps, run_dir = f"tests.jobs.hybrid:{job}", 256, tmp_path / "run"
    args = ["launch", "--job", name, "--dense", "allreduce", "--steps", str(steps), "--checkpoint-every", "0"]
    args += ["--steps-per-execution", "64", "--run-dir", str(run_dir)]
    metrics_file = run_dir / "metrics.jsonl"

    def second_block_running() -> bool:
        return metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 2  # step 0, then block 1..64

    first = run_pstrain(args, signal_when=second_block_running, send=signal.SIGTERM)
    assert first.returncode == 128 + signal.SIGTERM, first.output
    assert 0 < len(metrics(run_dir)[0]) < steps
    chief_log = (run_dir / "logs" / "chief-0.log").read_text()
    assert "stop noticed" in chief_log, "the stop came while a block ran, and ended it there"
    assert COPIES_PAST not in chief_log, "no closure went on past the step the ps did not apply"
    assert took_no_ps_path(run_dir) == (job == "dense_adam")
    assert_no_orphans(first)
    second = run_pstrain(args)
    assert second.returncode == 0, second.output
    assert [r["step"] for r in metrics(run_dir)[0]] == list(range(steps))
    largest, different = compare_checkpoints(run_dir, standalone(tmp_path, name, steps=steps))
    assert different == [] and largest == 0.0, (largest, different)
    assert_no_orphans(second)
