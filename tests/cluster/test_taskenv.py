"""The contracts between processes, each with one owner: the task environment (cluster/taskenv.py),
TF_CONFIG (cluster/tfconfig.py), the run directory (cluster/rundir.py) and the error line. Pure."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster.config import TrainConfig, resolve
from cluster.errors import ConfigError, PstrainError, report
from cluster.launch.launcher import control_env, credentials, shared_control_env
from cluster.launch.node import node_env
from cluster.launch.pod import pod_env
from cluster.rundir import RunDir
from cluster.task_setup import COMMON_ENV, cluster_spec, task_setup
from cluster.taskenv import TaskEnv
from cluster.tfconfig import chief_address, named_task_type, server_task, task_tf_config

pytestmark = pytest.mark.pure
ROOT = Path(__file__).resolve().parents[2]


def test_launch_node_slurm_and_task_give_a_worker_the_same_environment(tmp_path):
    """One config, four ways to start its worker 0: the same PSTRAIN_* variables, with the config's
    registration timeout (once set by `pstrain task` only; a worker under launch or node waited 60 s)."""
    (tmp_path / "token").write_text("s3cret\n")
    cluster = {
        "chief": "127.0.0.1:7001",
        "ps": ["127.0.0.1:7002"],
        "workers": ["127.0.0.1:7003", "127.0.0.1:7004"],
        "control": "127.0.0.1:7000",
        "heartbeat_interval": 0.5,
        "heartbeat_timeout": 4,
        "token_file": str(tmp_path / "token"),
    }
    raw = {"cluster": cluster, "train": {"startup_timeout": 45, "run_dir": str(tmp_path / "run")}}
    config = resolve(raw)
    worker = task_setup(config.cluster, "worker", 0).env

    launch = {**worker, **control_env(config, credentials(config.cluster, generate=True))}
    node = {**worker, **node_env(config, config.cluster, credentials(config.cluster, generate=False))}
    tf_config = task_tf_config(cluster_spec(config.cluster), "worker", 0)
    _, task_type, pod = pod_env(raw, {"TF_CONFIG": tf_config}, control_port=7000)
    task = {**COMMON_ENV, **pod}
    slurm = {**worker, **shared_control_env(config)}  # what run_slurm_node hands the tasks of a second node

    assert task_type == "worker"
    contract = {
        "PSTRAIN_CONTROL": "127.0.0.1:7000",
        "PSTRAIN_HEARTBEAT_INTERVAL": "0.5",
        "PSTRAIN_HEARTBEAT_TIMEOUT": "4.0",
        "PSTRAIN_REGISTER_TIMEOUT": "45.0",
        "PSTRAIN_TOKEN": "s3cret",
    }
    for name, env in (("launch", launch), ("node", node), ("task", task), ("slurm", slurm)):
        assert {k: v for k, v in env.items() if k.startswith("PSTRAIN_")} == contract, name
        assert {k: env[k] for k in (*COMMON_ENV, "TF_CONFIG")} == {**COMMON_ENV, "TF_CONFIG": tf_config}, name
    assert TaskEnv.from_env(launch).register_timeout == 45.0


def test_node_given_only_the_chief_uses_the_default_registration_timeout():
    config = resolve({"cluster": {"control": "10.0.0.1:7000"}})
    env = node_env(None, config.cluster, credentials(config.cluster, generate=True))
    assert TaskEnv.from_env(env).register_timeout == TrainConfig().startup_timeout


def test_task_env_round_trips_and_defaults_are_the_configs():
    env = TaskEnv("h:1", 0.5, 3.0, 12.0, "t", "/ca.pem", parent_pid=42, ready_file="/r", tty=True)
    assert TaskEnv.from_env(env.to_env()) == env
    defaults = TaskEnv.from_env({})
    config = resolve({})
    assert defaults.control == "" and defaults.parent_pid is None and not defaults.tty
    assert (defaults.heartbeat_interval, defaults.heartbeat_timeout) == (
        config.cluster.heartbeat_interval,
        config.cluster.heartbeat_timeout,
    )
    assert defaults.register_timeout == config.train.startup_timeout
    assert TaskEnv().to_env() == {}  # standalone: nothing to hand on


def product_variables() -> set[str]:
    """Every PSTRAIN_* name in the product's code and deploy scripts."""
    names: set[str] = set()
    for folder in ("cluster", "chief", "worker", "deploy"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and path.is_file():
                names |= set(re.findall(r"PSTRAIN_[A-Z_]+", path.read_text()))
    return names


def test_every_variable_read_in_the_code_is_documented():
    documented = set(re.findall(r"`(PSTRAIN_[A-Z_]+)`", (ROOT / "docs" / "environment.md").read_text()))
    found = product_variables()
    assert "PSTRAIN_REGISTER_TIMEOUT" in found and "PSTRAIN_READ_AHEAD" in found  # the scan sees the code
    assert found - documented == set(), "add these to docs/environment.md"


def test_tf_config_readers_keep_their_one_line_errors():
    with pytest.raises(ConfigError, match="TF_CONFIG is invalid"):
        server_task("{not json")
    with pytest.raises(ConfigError, match="missing from its cluster"):
        server_task(json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 3}}))
    with pytest.raises(ConfigError, match="is not 'worker' or 'ps'"):
        server_task(json.dumps({"cluster": {"chief": ["h:1"]}, "task": {"type": "chief", "index": 0}}))
    given = {"chief": ["c:1"], "ps": ["p:1"], "worker": ["w:1"], "evaluator": ["e:1"]}
    raw = json.dumps({"cluster": given, "task": {"type": "evaluator", "index": 0}})
    assert named_task_type(raw) == "evaluator" and named_task_type("{") is None and named_task_type(None) is None
    assert chief_address(raw) == "c:1" and chief_address(None) == "" and chief_address('{"cluster": {}}') == ""
    assert server_task(task_tf_config(given, "ps", 0)) == (given, "ps", 0)


def test_run_dir_reads_metrics_and_done_by_record_not_by_substring(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_metrics() == [] and not run.is_done()
    lines = [
        json.dumps({"step": 0, "loss": 1.0, "note": '"event": "done"'}),  # the text, not the event
        json.dumps({"event": "eval", "step": 1}),
        '{"step": 2, "lo',  # cut short by a crash
    ]
    run.metrics.write_text("\n".join(lines) + "\n")
    assert [r.get("step") for r in run.read_metrics()] == [0, 1]
    assert not run.is_done()
    with run.metrics.open("a") as f:
        f.write(json.dumps({"event": "done", "steps": 2}) + "\n")
    assert run.is_done()


def test_one_error_line_and_its_exit_code(capsys):
    assert report(ConfigError("train.steps: 0; give at least 1")) == 2
    assert report(PstrainError("lost")) == 1
    assert report("a bare message", 75) == 75
    assert capsys.readouterr().err.splitlines() == [
        "pstrain: error: train.steps: 0; give at least 1",
        "pstrain: error: lost",
        "pstrain: error: a bare message",
    ]
