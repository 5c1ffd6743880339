"""User mistakes: one line naming the problem and the fix, a non-zero exit, no traceback, no orphans."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from tests import helpers
from tests.helpers import PSTRAIN, ROOT, assert_no_orphans, run_pstrain

pytestmark = pytest.mark.cluster


def assert_one_line_error(result, startswith: str, code: int = 2) -> None:
    assert result.returncode == code, result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("pstrain: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"pstrain: error: {startswith}"), result.output


def test_malformed_config_file(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[train]\nsteps = = 3\n")
    result = run_pstrain(["launch", "--config", str(config), "--run-dir", str(tmp_path / "run")], timeout=60)
    assert_one_line_error(result, f"--config: {config} is not valid TOML")
    assert not (tmp_path / "run").exists(), "nothing is created for a bad config"
    assert not result.seen_pids


def test_unknown_field_suggests_the_right_one(tmp_path):
    config = tmp_path / "typo.toml"
    config.write_text("[cluster]\nworkres = 2\n")
    result = run_pstrain(["launch", "--config", str(config)], timeout=60)
    assert_one_line_error(result, "[cluster] workres: unknown field; did you mean 'workers'?")


def test_more_replicas_to_aggregate_than_computed(tmp_path):
    args = ["launch", "--replicas-to-aggregate", "3", "--total-num-replicas", "2", "--run-dir", str(tmp_path / "r")]
    assert_one_line_error(run_pstrain(args, timeout=60), "train.replicas_to_aggregate: 3 is larger")


def test_job_module_that_does_not_exist(tmp_path):
    result = run_pstrain(["launch", "--job", "no_such_pkg.job", "--run-dir", str(tmp_path / "r")], timeout=60)
    assert_one_line_error(result, "train.job: module 'no_such_pkg.job' not found")
    assert not result.seen_pids, "no task is started for a job that cannot be found"


def test_port_already_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "c.toml"
        config.write_text(f'[cluster]\nps = ["127.0.0.1:{port}"]\n')
        result = run_pstrain(["launch", "--config", str(config), "--run-dir", str(tmp_path / "r")], timeout=60)
    assert_one_line_error(result, f"cluster.ps[0]: cannot listen on 127.0.0.1:{port}")
    assert not result.seen_pids


@pytest.mark.parametrize(
    "tf_config, message",
    [
        ("{not json", "TF_CONFIG is invalid"),
        (json.dumps({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 3}}), "missing from"),
        (
            json.dumps({"cluster": {"evaluator": ["127.0.0.1:1"]}, "task": {"type": "evaluator", "index": 0}}),
            "pstrain server: TF_CONFIG task type 'evaluator' evaluates a run's checkpoints; give it the run directory",
        ),
    ],
)
def test_server_with_invalid_tf_config(tf_config, message):
    env = {k: v for k, v in os.environ.items() if k != "PSTRAIN_RUN_DIR"}
    result = subprocess.run(
        PSTRAIN + ["server"], cwd=ROOT, env={**env, "TF_CONFIG": tf_config}, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.startswith("pstrain: error: ") and len(result.stderr.splitlines()) == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


ASSERT_LINE = 'message="the bias moved"'  # FrozenBias's assertion in tests/jobs/broken.py


def job_line(text: str) -> str:
    """tests/jobs/broken.py:N, N the line that holds `text`: where a job's error must point."""
    lines = (ROOT / "tests" / "jobs" / "broken.py").read_text().splitlines()
    return f"tests/jobs/broken.py:{next(i for i, line in enumerate(lines, 1) if text in line)}"


@pytest.mark.parametrize(
    "job, code, message, where",
    [
        ("tests.jobs.broken:NoModel", 2, "--job tests.jobs.broken:NoModel: missing model_fn", ""),
        ("tests.jobs.broken:Raises", 2, "ValueError: layer sizes must be positive", "layer sizes must be positive"),
        ("tests.jobs.broken:Diverges", 1, "step 0: loss is nan", ""),
        ("tests.jobs.broken:AssertsAtStep1", 2, "InvalidArgumentError: assertion failed: [the bias moved]", ASSERT_LINE),
    ],
)
def test_bad_jobs_fail_cleanly_on_a_real_cluster(tmp_path, job, code, message, where):
    result = run_pstrain(["launch", "--job", job, "--steps", "5", "--run-dir", str(tmp_path / "r")], timeout=180)
    assert_one_line_error(result, message, code=code)
    log = tmp_path / "r" / "logs" / "chief-0.log"
    assert f"pstrain: chief-0 exited with code {code}; its log: {log}" in result.output
    assert "I0000" not in result.output and "oneDNN" not in result.output, "TensorFlow's output stays in the logs"
    assert len(result.seen_pids) >= 4, "the cluster was started"
    if where:  # the job's own line, the step and worker of a run-time error; the traceback in the chief's log
        # A step with no ps on its path (the hybrid on a model with no table) does not know its global step.
        at_step = "call); traceback in" if helpers.DENSE == "allreduce" else "call) at step 1 on worker "
        function = at_step if "Asserts" in job else "model_fn); traceback in"
        assert f"({job_line(where)} in {function}" in result.output, result.output
        assert "Traceback (most recent call last)" in log.read_text() and "grpc_message" not in result.output
    assert_no_orphans(result)


@pytest.mark.parametrize(
    "job, code, message",
    [
        ("Diverges", 1, "step 0: loss is nan"),
        ("LossRaises", 2, "ValueError: boom: this loss is not written yet ({} in loss_fn); traceback in"),
        ("AssertsAtStep1", 2, "InvalidArgumentError: assertion failed: [the bias moved]"),
    ],
)
def test_standalone_reports_the_same_errors(tmp_path, job, code, message):
    """A loss_fn raising while traced is the job's bug, not a shape mismatch: its own line, exit 2."""
    args = ["train", "--standalone", "--job", f"tests.jobs.broken:{job}", "--run-dir", str(tmp_path / "r")]
    result = run_pstrain(args, timeout=120)
    assert_one_line_error(result, message.format(job_line("boom: this loss")), code=code)
    if job == "AssertsAtStep1":
        assert f"({job_line(ASSERT_LINE)} in call) at step 1; traceback in" in result.output


def test_a_stream_in_no_fixed_order_is_refused_before_training(tmp_path):
    args = ["train", "--standalone", "--job", "tests.jobs.broken:UnorderedRecords", "--run-dir", str(tmp_path / "r")]
    result = run_pstrain(args, timeout=120, env={"PSTRAIN_DATA_DIR": str(tmp_path / "data")})
    job = "--job tests.jobs.broken:UnorderedRecords"
    message = f"{job}: train_dataset(): two builds of the pipeline gave different first examples"
    assert_one_line_error(result, message)
    assert "list_files(..., shuffle=False)" in result.output and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_gpu_index_the_machine_does_not_have(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[cluster]\nworker_gpus = [0, 7]\n")
    result = run_pstrain(["launch", "--config", str(config), "--run-dir", str(tmp_path / "r")], timeout=60)
    assert_one_line_error(result, "cluster.worker_gpus[")
    assert "does not exist on this machine" in result.output
    assert not result.seen_pids


def test_unreachable_host_fails_listing_the_missing_task(tmp_path):
    # 10.251.9.9 is an address no namespace has: the launcher only waits for the task to register
    # (it never connects there), then fails naming it. The local tasks register within the timeout
    # even on a busy machine (they start with the chief, which imports TensorFlow beside them).
    config = tmp_path / "c.toml"
    config.write_text('[cluster]\nworkers = ["127.0.0.1:0", "10.251.9.9:2222"]\n[train]\nstartup_timeout = 20\n')
    result = run_pstrain(["launch", "--config", str(config), "--run-dir", str(tmp_path / "r")], timeout=120)
    assert_one_line_error(result, "tasks not registered after 20s: worker:1 expected at 10.251.9.9:2222", code=1)
    assert_no_orphans(result)


def test_run_dir_written_by_an_incompatible_config_is_left_alone(tmp_path):
    run_dir = tmp_path / "r"
    first = run_pstrain(["train", "--standalone", "--steps", "5", "--run-dir", str(run_dir)], timeout=120)
    assert first.returncode == 0, first.output
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    result = run_pstrain(["launch", "--steps", "5", "--seed", "1", "--run-dir", str(run_dir)], timeout=60)
    assert_one_line_error(result, f"--run-dir: {run_dir} was written with seed=0, not 1")
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == before, "nothing was touched"
    assert not result.seen_pids
