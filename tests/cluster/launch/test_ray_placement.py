"""The Ray engine's pure parts: the placement group, TF_CONFIG from where Ray placed each task, the
config fields, and the one-line refusals (no Ray started here: tests/system/test_ray.py runs it)."""

from __future__ import annotations

import json
import sys

import pytest

from cluster.config import ConfigError, resolve
from cluster.launch.ray_placement import (
    Placed,
    check_counts_only,
    loopback_address,
    placed_cluster,
    reservation,
    tasks_of,
    unshared_nodes,
)
from cluster.task import TaskId
from cluster.task_setup import task_setup

pytestmark = pytest.mark.pure


def ray_cluster(**fields):
    return resolve({"cluster": {"engine": "ray", "ps": 2, "workers": 3, **fields}, "train": {"global_batch_size": 48}}).cluster


def test_one_bundle_per_task_reserved_at_once_gpus_for_workers_only():
    plan = reservation(ray_cluster(), worker_gpus=True)
    assert plan.strategy == "PACK"
    assert plan.bundles == [{"CPU": 1.0}] * 2 + [{"CPU": 1.0, "GPU": 1.0}] * 3 + [{"CPU": 1.0}]
    assert [plan.bundle_of[t] for t in tasks_of(ray_cluster())] == list(range(6))
    assert reservation(ray_cluster(), worker_gpus=False).bundles == [{"CPU": 1.0}] * 6


def test_spread_workers_puts_each_worker_on_a_node_of_its_own():
    plan = reservation(ray_cluster(spread_workers=True), worker_gpus=False)
    assert plan.strategy == "STRICT_SPREAD"
    assert len(plan.bundles) == 3, "one bundle, hence one node, per worker"
    assert {plan.bundle_of[TaskId("worker", i)] for i in range(3)} == {0, 1, 2}
    assert plan.bundle_of[TaskId("ps", 0)] == 0 and plan.bundle_of[TaskId("ps", 1)] == 1
    assert plan.bundle_of[TaskId("chief", 0)] == 0
    assert [b["CPU"] for b in plan.bundles] == [3.0, 2.0, 1.0], "ps and chief ride in worker bundles"


def test_tf_config_comes_from_each_tasks_node_and_port_and_its_gpu():
    cluster = ray_cluster()
    placed = {TaskId("chief", 0): Placed("10.0.0.1", 4000)}
    placed |= {TaskId("ps", i): Placed("10.0.0.1", 4001 + i) for i in range(2)}
    placed |= {TaskId("worker", i): Placed(f"10.0.0.{i + 1}", 5000, (3,) if i == 2 else ()) for i in range(3)}
    ran = placed_cluster(cluster, placed, "10.0.0.1:7000")
    assert ran.ps == ("10.0.0.1:4001", "10.0.0.1:4002")
    assert ran.workers == ("10.0.0.1:5000", "10.0.0.2:5000", "10.0.0.3:5000")
    assert ran.worker_gpus == (None, None, 3) and ran.control == "10.0.0.1:7000"
    worker = task_setup(ran, "worker", 2)
    assert worker.env["CUDA_VISIBLE_DEVICES"] == "3", "the GPU Ray gave the worker's actor"
    spec = json.loads(worker.env["TF_CONFIG"])
    assert spec["cluster"]["chief"] == ["10.0.0.1:4000"] and spec["task"] == {"type": "worker", "index": 2}


def test_the_config_fields_and_their_refusals():
    assert ray_cluster(ray_address="auto").ray_address == "auto"
    assert resolve({}, {"engine": "ray", "ray_address": "10.0.0.1:6379"}).cluster.ray_address == "10.0.0.1:6379"
    for fields, message in (
        ({"engine": "yarn"}, 'cluster.engine: expected "local" or "ray"'),
        ({"engine": "ray", "ray_address": "nohost"}, "cluster.ray_address: expected 'host:port'"),
        ({"engine": "ray", "spread_workers": "yes"}, "cluster.spread_workers: expected true or false"),
        ({"ray_address": "auto"}, 'cluster.ray_address: applies to engine = "ray" only'),
    ):
        with pytest.raises(ConfigError, match=message):
            resolve({"cluster": fields})
    with pytest.raises(ConfigError, match=r'cluster.workers\[1\]: engine = "ray" places every task itself'):
        check_counts_only(resolve({"cluster": {"engine": "ray", "workers": ["127.0.0.1:0", "127.0.0.1:5000"]}}).cluster)


def test_unshared_nodes_and_loopback_addresses():
    assert unshared_nodes({"10.0.0.1": True, "10.0.0.3": False, "10.0.0.2": False}) == ["10.0.0.2", "10.0.0.3"]
    assert loopback_address("127.0.0.1:6379") and not loopback_address("10.0.0.1:6379")
    assert not loopback_address("") and not loopback_address("auto")


def test_without_ray_installed_one_line_says_how_to_install_it(monkeypatch):
    from cluster.launch.ray_engine import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where it is not installed
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    with pytest.raises(ConfigError, match=r"^cluster.engine: \"ray\" needs Ray; install it with: pip install \.\[ray\]$"):
        import_ray("10.0.0.1:6379")
