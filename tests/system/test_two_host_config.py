"""The netns tests' one two-host job (tests/system/two_hosts.py) is a config pstrain reads as meant:
the chief, control plane, ps and workers where the options put them. Pure."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from cluster.config import resolve
from cluster.task_setup import cluster_spec
from tests.netns import Host
from tests.system.two_hosts import node_argv, two_host_config

pytestmark = pytest.mark.pure

HOSTS = {"a": Host("pa", "10.9.0.1", "va"), "b": Host("pb", "10.9.0.2", "vb")}


def test_the_default_job_puts_a_worker_on_each_host_and_the_rest_on_a():
    text = two_host_config(HOSTS, Path("/t/token"), cluster={"heartbeat_timeout": 5.0}, steps=30, run_dir=Path("/t/run"))
    config = resolve(tomllib.loads(text))
    assert cluster_spec(config.cluster) == {
        "chief": ["10.9.0.1:2220"],
        "ps": ["10.9.0.1:2221"],
        "worker": ["10.9.0.1:2222", "10.9.0.2:2222"],
    }
    assert (config.cluster.control, config.cluster.token_file) == ("10.9.0.1:2229", "/t/token")
    assert (config.cluster.heartbeat_interval, config.cluster.heartbeat_timeout) == (0.5, 5.0)
    assert (config.train.steps, config.train.run_dir) == (30, "/t/run")
    assert node_argv(HOSTS["a"], Path("/t/token"), Path("/t/node")) == [
        "node", "--chief", "10.9.0.1:2229", "--token-file", "/t/token", "--log-dir", "/t/node",
    ]  # fmt: skip


def test_the_ps_on_b_and_two_workers_on_a_take_the_next_port():
    config = resolve(tomllib.loads(two_host_config(HOSTS, Path("/t/token"), ps="b", workers="aa", run_dir="/t/run")))
    assert cluster_spec(config.cluster)["ps"] == ["10.9.0.2:2221"]
    assert cluster_spec(config.cluster)["worker"] == ["10.9.0.1:2222", "10.9.0.1:2223"]
