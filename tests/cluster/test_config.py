"""Config parsing, validation errors and TF_CONFIG/env generation (pure logic)."""

import json

import pytest
from tensorflow.core.protobuf import config_pb2  # noqa: F401  imported here: the test itself starts no process

from cluster.config import ConfigError, resolve
from cluster.rundir import check_compatible
from cluster.task_setup import cluster_spec, gpu_line, gpu_sharers, server_setups, task_setup
from cluster.taskenv import TaskEnv
from cluster.tfconfig import task_tf_config
from worker.server import server_config

pytestmark = pytest.mark.pure


def test_defaults_one_chief_one_ps_two_workers():
    config = resolve({})
    assert len(config.cluster.ps) == 1 and len(config.cluster.workers) == 2
    assert config.cluster.chief == "127.0.0.1:0"
    assert config.train.replicas_to_aggregate == 2 and config.train.total_num_replicas == 2
    assert config.train.slot_batch_size == 32


def test_auto_gpus_follow_the_machine():
    assert resolve({}, gpu_count=2).cluster.worker_gpus == (0, 1)
    assert resolve({}, gpu_count=0).cluster.worker_gpus == (None, None)


def test_auto_shares_the_gpus_round_robin_and_never_mixes_them_with_the_cpu():
    # The staging case: 2 workers on a 1-GPU box both train on it (the extra one used to land on the CPU).
    assert resolve({}, gpu_count=1).cluster.worker_gpus == (0, 0)
    five = {"cluster": {"workers": 5}, "train": {"global_batch_size": 60}}
    assert resolve(five, gpu_count=2).cluster.worker_gpus == (0, 1, 0, 1, 0)
    # A mix only when the config asks for it by index; a GPU memory limit per worker is a checked field.
    assert resolve({"cluster": {"worker_gpus": [0, -1]}}, gpu_count=1).cluster.worker_gpus == (0, None)
    assert resolve({"cluster": {"worker_gpu_memory_mb": 4096}}, gpu_count=1).cluster.worker_gpu_memory_mb == 4096
    with pytest.raises(ConfigError, match=r"cluster.worker_gpu_memory_mb: must be >= 0"):
        resolve({"cluster": {"worker_gpu_memory_mb": -1}})


def test_flags_override_file():
    raw = {"cluster": {"workers": 4}, "train": {"steps": 10, "seed": 3}}
    config = resolve(raw, {"workers": 3, "steps": 20, "seed": None, "global_batch_size": 60})
    assert len(config.cluster.workers) == 3
    assert config.train.steps == 20 and config.train.seed == 3
    assert config.train.replicas_to_aggregate == 3


def test_control_plane_settings():
    raw = {"cluster": {"chief": "10.0.0.1:2220", "heartbeat_interval": 0.5, "heartbeat_timeout": 2}}
    cluster = resolve(raw).cluster
    assert cluster.control == "10.0.0.1:0"  # on the chief's host by default
    assert (cluster.heartbeat_interval, cluster.heartbeat_timeout) == (0.5, 2.0)


def test_explicit_addresses_and_gpus():
    raw = {
        "cluster": {
            "chief": "10.0.0.1:2220",
            "ps": ["10.0.0.1:2221"],
            "workers": ["10.0.0.1:2222", "10.0.0.2:2222"],
            "worker_gpus": [0, -1],
        }
    }
    cluster = resolve(raw).cluster
    assert cluster.workers == ("10.0.0.1:2222", "10.0.0.2:2222")
    assert cluster.worker_gpus == (0, None)


@pytest.mark.parametrize(
    "raw, overrides, field",
    [
        ({"train": {"stepz": 3}}, {}, "[train] stepz: unknown field; did you mean 'steps'?"),
        ({"trian": {}}, {}, "[trian]: unknown section; did you mean [train]?"),
        ({"train": {"steps": "ten"}}, {}, "train.steps: expected an integer"),
        ({"train": {"steps": 0}}, {}, "train.steps: must be >= 1"),
        ({}, {"replicas_to_aggregate": 3, "total_num_replicas": 2}, "train.replicas_to_aggregate: 3 is larger"),
        ({}, {"global_batch_size": 63}, "train.global_batch_size: 63 does not split evenly"),
        ({"cluster": {"ps": ["127.0.0.1:5000"], "workers": ["127.0.0.1:5000"]}}, {}, "cluster.workers[0]: address"),
        ({"cluster": {"workers": ["nohost"]}}, {}, "cluster.workers[0]: expected 'host:port'"),
        ({"cluster": {"worker_gpus": [0, 7]}}, {}, "cluster.worker_gpus[1]: GPU 7 does not exist"),
        ({"cluster": {"worker_gpus": [0]}}, {}, "cluster.worker_gpus: expected"),
        ({"cluster": {"workers": 0}}, {}, "cluster.workers: must be >= 1"),
        ({"cluster": {"heartbeat_timeout": 1.0}}, {}, "cluster.heartbeat_timeout: 1s must exceed"),
        ({"cluster": {"control": "127.0.0.1:7000", "chief": "127.0.0.1:7000"}}, {}, "cluster.control: address"),
    ],
)
def test_invalid_fields_name_the_field(raw, overrides, field):
    with pytest.raises(ConfigError) as error:
        resolve(raw, overrides, gpu_count=2)
    message = str(error.value)
    assert message.startswith(field), message
    assert "\n" not in message


def test_tf_config_and_env_per_task():
    raw = {"cluster": {"chief": "h:1", "ps": ["h:2"], "workers": ["h:3", "h:4"], "worker_gpus": [1, 0]}}
    cluster = resolve(raw, gpu_count=2).cluster
    spec = {"chief": ["h:1"], "ps": ["h:2"], "worker": ["h:3", "h:4"]}
    written = json.loads(task_tf_config(cluster_spec(cluster), "worker", 1))
    assert written == {"cluster": spec, "task": {"type": "worker", "index": 1}}
    servers = server_setups(cluster)
    assert [p.task.log_name for p in servers] == ["ps-0", "worker-0", "worker-1"]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in servers] == ["", "1", "0"]
    chief = task_setup(cluster, "chief", 0)
    assert chief.env["CUDA_VISIBLE_DEVICES"] == "" and chief.address == "h:1"
    assert all(p.env["GRPC_FAIL_FAST"] == "use_caller" for p in servers + [chief])


def test_workers_sharing_a_gpu_get_memory_growth_or_the_configured_limit_and_one_launch_line():
    three = {"cluster": {"workers": 3}, "train": {"global_batch_size": 60}}
    shared = resolve(three, gpu_count=2).cluster  # workers 0 and 2 share GPU 0
    envs = [p.env for p in server_setups(shared) if p.task.type == "worker"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "0"]
    assert [e.get("TF_FORCE_GPU_ALLOW_GROWTH") for e in envs] == ["true", None, "true"]
    assert gpu_line(shared) == "worker 0 GPU 0, worker 1 GPU 1, worker 2 GPU 0; shared: GPU 0 by workers 0, 2 (memory growth on)"
    limited = resolve({"cluster": {"worker_gpu_memory_mb": 2048}}, gpu_count=1).cluster
    envs = [p.env for p in server_setups(limited) if p.task.type == "worker"]
    assert [(e["CUDA_VISIBLE_DEVICES"], e["PSTRAIN_GPU_MEMORY_MB"]) for e in envs] == [("0", "2048"), ("0", "2048")]
    assert not any("TF_FORCE_GPU_ALLOW_GROWTH" in e for e in envs)
    assert gpu_line(limited).endswith("shared: GPU 0 by workers 0, 1 (each worker limited to 2048 MiB)")
    # The same index on two machines is two GPUs: no sharing there.
    apart = resolve({"cluster": {"workers": ["a:1", "b:1"], "worker_gpus": [0, 0]}}, gpu_count=1).cluster
    assert gpu_line(apart) == "worker 0 GPU 0, worker 1 GPU 0" and gpu_sharers(apart) == {("a", 0): [0], ("b", 0): [1]}
    assert gpu_line(resolve({}, gpu_count=0).cluster) == "workers on the CPU (2)"


def test_a_workers_server_takes_its_gpu_memory_limit_from_the_plan():
    assert server_config(TaskEnv.from_env({})) is None
    config = server_config(TaskEnv.from_env({"PSTRAIN_GPU_MEMORY_MB": "2048"}))
    assert list(config.gpu_options.experimental.virtual_devices[0].memory_limit_mb) == [2048.0]
    with pytest.raises(ConfigError, match="PSTRAIN_GPU_MEMORY_MB: expected a positive number"):
        server_config(TaskEnv.from_env({"PSTRAIN_GPU_MEMORY_MB": "lots"}))


def test_run_dir_written_by_other_settings_is_refused():
    config = resolve({}, {"run_dir": "runs/x"})
    check_compatible({"train": {"seed": 0, "global_batch_size": 64}}, config.train)
    with pytest.raises(ConfigError, match="--run-dir: runs/x was written with seed=1"):
        check_compatible({"train": {"seed": 1}}, config.train)


@pytest.mark.pure
def test_train_dense_is_ps_by_default_and_checked():
    assert resolve({}, {}).train.dense == "ps"
    assert resolve({"train": {"dense": "allreduce"}}, {}).train.dense == "allreduce"
    with pytest.raises(ConfigError, match="train.dense: expected 'ps' or 'allreduce'"):
        resolve({"train": {"dense": "ring"}}, {})
