"""Kubernetes: `pstrain render tfjob` checked three ways, and `pstrain task` under an injected TF_CONFIG.

1. The TFJob against the CRD's schema (v1.9.0) with unknown fields refused, plus the webhook's rules.
2. The operator's TF_CONFIG and Service names for every pod (tests/tfjob_operator.py), read by pstrain.
3. End to end: one network namespace per pod, each /etc/hosts mapping the Service names, each pod
   running the rendered command with the environment the operator and kubelet would give it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import yaml

from chief.jobs import digits
from cluster.config import ConfigError, resolve
from cluster.control.agent import Agent
from cluster.control.registry import Registry
from cluster.control.security import Credentials
from cluster.control.service import ControlService, serve
from cluster.launch.launcher import shared_control_env
from cluster.launch.ports import free_port
from cluster.render.tfjob import TFJobOptions, render_tfjob
from cluster.tfconfig import config_for_tf_config, control_address, parse_tf_config
from cluster.versions import local_versions
from tests import tfjob_operator as operator
from tests.helpers import (
    Result,
    alive,
    assert_both_workers_each_step,
    assert_no_orphans,
    descendant_pids,
    metrics,
    predictions,
    run_pstrain,
    step_lines,
)
from tests.netns import can_create_namespaces, lan

CONFIG = """\
[cluster]
ps = 1
workers = 2
heartbeat_interval = 0.5
heartbeat_timeout = 10.0

[train]
steps = {steps}
checkpoint_every = 10
startup_timeout = 120.0
"""
SECRETS = {"demo-token": {"token": "s3cret-for-tests"}}


def render(tmp_path: Path, *flags: str, steps: int = 20) -> list[dict]:
    config = tmp_path / "cluster.toml"
    config.write_text(CONFIG.format(steps=steps))
    out = tmp_path / "tfjob.yaml"
    argv = ["render", "tfjob", "--config", str(config), "--image", "registry.example/pstrain:0.1", "--output", str(out)]
    result = run_pstrain(argv + ["--name", "demo", "--namespace", "ml", *flags], timeout=120)
    assert result.returncode == 0, result.output
    return list(yaml.safe_load_all(out.read_text()))


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> list[dict]:
    return render(tmp_path_factory.mktemp("render"))


def tfjob_of(documents: list[dict]) -> dict:
    [tfjob] = [d for d in documents if d["kind"] == "TFJob"]
    return tfjob


# 1. The CRD schema, strictly, and the webhook's rules.


@pytest.mark.cluster
def test_rendered_tfjob_satisfies_the_crd_schema_with_unknown_fields_refused(manifest):
    tfjob = tfjob_of(manifest)
    schema = operator.strict(operator.crd_schema())
    jsonschema.validate(tfjob, schema)
    assert operator.webhook_errors(tfjob) == []
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert {k: v["replicas"] for k, v in specs.items()} == {"Chief": 1, "PS": 1, "Worker": 2}
    assert tfjob["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    for rtype, spec in specs.items():
        [container] = spec["template"]["spec"]["containers"]
        assert spec["restartPolicy"] == "OnFailure"
        assert container["command"][:2] == ["pstrain", "task"], "one entry point for every pod"
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"tfjob-port": 2222, "pstrain-control": 2229}
        env = {e["name"]: e for e in container["env"]}
        assert env["PSTRAIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "demo-token", "key": "token"}
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert (gpus, env.get("NVIDIA_VISIBLE_DEVICES", {}).get("value")) == ((1, None) if rtype == "Worker" else (None, "void"))
    volumes = specs["Chief"]["template"]["spec"]["volumes"]
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "demo-runs"}} in volumes


NETWORK_POLICY_SCHEMA = Path(__file__).resolve().parents[1] / "data" / "networkpolicy-networking-v1.json"


@pytest.mark.cluster
def test_the_network_policy_admits_the_jobs_own_pods_only_and_passes_the_schema(manifest):
    """TF's servers (unauthenticated) and the control port: reached from this job's pods only."""
    [policy] = [d for d in manifest if d["kind"] == "NetworkPolicy"]
    schema = json.loads(NETWORK_POLICY_SCHEMA.read_text())
    jsonschema.validate(policy, schema)
    own = {"app.kubernetes.io/name": "pstrain", "app.kubernetes.io/instance": "demo"}
    assert policy["metadata"]["namespace"] == "ml" and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"] == {"matchLabels": own}
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": own}}], "ports": [{"protocol": "TCP", "port": p} for p in (2222, 2229)]}
    ]
    for spec in tfjob_of(manifest)["spec"]["tfReplicaSpecs"].values():  # every pod is one the policy selects
        assert own.items() <= spec["template"]["metadata"]["labels"].items()
    bad = json.loads(json.dumps(policy))
    bad["spec"]["ingress"][0]["form"] = bad["spec"]["ingress"][0].pop("from")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    status = render_tfjob(resolve({}), TFJobOptions("img", status_from="role=ops"))[2]["spec"]["ingress"][1]
    assert status == {"from": [{"podSelector": {"matchLabels": {"role": "ops"}}}], "ports": [{"protocol": "TCP", "port": 2229}]}
    jsonschema.validate(render_tfjob(resolve({}), TFJobOptions("img", status_from="role=ops"))[2], schema)


@pytest.mark.cluster
def test_the_strict_schema_and_the_webhook_rules_do_refuse(manifest):
    schema = operator.strict(operator.crd_schema())
    tfjob = json.loads(json.dumps(tfjob_of(manifest)))  # a copy: the fixture is shared
    container = tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    for path, value in ((("spec", "runPolicy", "cleanPodPolicyy"), "Running"), (("spec", "replicas"), 3)):
        bad = json.loads(json.dumps(tfjob))
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    container["imagePullPolicyy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(tfjob, schema)
    del container["imagePullPolicyy"]
    container["name"] = "main"
    tfjob["metadata"]["name"] = "Demo_Job"
    tfjob["spec"]["tfReplicaSpecs"]["Master"] = tfjob["spec"]["tfReplicaSpecs"]["Chief"]
    tfjob["spec"]["tfReplicaSpecs"]["PS"]["restartPolicy"] = "Sometimes"
    errors = " | ".join(operator.webhook_errors(tfjob))
    for expected in ("DNS-1035", "Worker: no container named tensorflow", "more than one Chief/Master", "Sometimes"):
        assert expected in errors


@pytest.mark.pure
@pytest.mark.parametrize(
    "options, message",
    [
        (TFJobOptions("img", name="Demo_Job"), "--name: 'Demo_Job' is not a DNS-1035 label"),
        (TFJobOptions("img", namespace="ML"), "--namespace: 'ML' is not a valid Kubernetes name"),
        (TFJobOptions(" "), "--image: empty"),
        (TFJobOptions("img", control_port=2222), "--control-port: 2222 must be a port 1-65535 other than 2222"),
        (TFJobOptions("img", gpus_per_pod=2), "--worker-gpus: 2; pstrain pins one GPU per worker"),
        (TFJobOptions("img", status_from="ops"), "--status-from: 'ops'; give a pod label as KEY=VALUE"),
    ],
)
def test_render_refuses_what_the_api_server_or_pstrain_would(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        render_tfjob(resolve({}), options)


@pytest.mark.cluster
def test_render_errors_reach_the_console_in_one_line(tmp_path):
    (tmp_path / "c.toml").write_text("[cluster]\nworkers = 2\n")
    result = run_pstrain(["render", "tfjob", "--config", str(tmp_path / "c.toml"), "--image", "i", "--name", "x_y"], timeout=120)
    assert result.returncode == 2
    assert result.output.strip().splitlines() == [
        "pstrain: error: --name: 'x_y' is not a DNS-1035 label of at most 40 characters; use e.g. pstrain-digits"
    ]


# 2. The operator's TF_CONFIG and Service names, as pstrain reads them.


@pytest.mark.cluster
def test_operator_tf_config_for_each_pod_names_its_role_and_the_services(manifest):
    tfjob = tfjob_of(manifest)
    assert operator.tf_config(tfjob, "Worker", 1) == (
        '{"cluster":{"chief":["demo-chief-0.ml.svc:2222"],"ps":["demo-ps-0.ml.svc:2222"],'
        '"worker":["demo-worker-0.ml.svc:2222","demo-worker-1.ml.svc:2222"]},'
        '"task":{"type":"worker","index":1},"environment":"cloud"}'
    )
    services = operator.services(tfjob)
    assert sorted(services) == ["demo-chief-0", "demo-ps-0", "demo-worker-0", "demo-worker-1"]
    raw = {"cluster": {"ps": 1, "workers": 2}}
    for rtype, count in (("Chief", 1), ("PS", 1), ("Worker", 2)):
        for index in range(count):
            env = operator.pod_env(tfjob, rtype, index, SECRETS)
            assert env["PSTRAIN_TOKEN"] == "s3cret-for-tests"
            spec, task_type, task_index = parse_tf_config(env["TF_CONFIG"])
            assert (task_type, task_index) == (rtype.lower(), index)
            control = control_address(spec, 2229)
            cluster = config_for_tf_config(raw, spec, control).cluster
            for address in (cluster.chief, *cluster.ps, *cluster.workers, control):
                host, port = address.rsplit(":", 1)
                service, namespace, svc = host.split(".")
                assert (namespace, svc) == ("ml", "svc") and int(port) in services[service].values()
            assert control == "demo-chief-0.ml.svc:2229" and services["demo-chief-0"]["pstrain-control"] == 2229


@pytest.mark.pure
def test_tf_config_translation_aliases_and_errors():
    base = {"cluster": {"master": ["m:1"], "ps": ["p:1"], "worker": ["w:1"], "evaluator": ["e:1"]}, "environment": "cloud"}
    spec, task_type, index = parse_tf_config(json.dumps({**base, "task": {"type": "master", "index": 0}}))
    assert (spec, task_type, index) == ({"chief": ["m:1"], "ps": ["p:1"], "worker": ["w:1"]}, "chief", 0)
    cases = [
        (None, "TF_CONFIG: not set"),
        ("{", "TF_CONFIG: invalid"),
        (json.dumps({**base, "task": {"type": "evaluator", "index": 0}}), "task type 'evaluator' is not chief, ps or worker"),
        (json.dumps({**base, "task": {"type": "worker", "index": 3}}), "task worker:3 is not in its cluster"),
        (json.dumps({"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": 0}}), "cluster has no chief, ps"),
        (json.dumps({"cluster": {**base["cluster"], "chief": ["c:1"]}, "task": {"type": "ps", "index": 0}}), "both chief and"),
        (json.dumps({**base, "cluster": {**base["cluster"], "ps": ["nohost"]}, "task": {"type": "ps", "index": 0}}), "ps\\[0\\]"),
    ]
    for raw, message in cases:
        with pytest.raises(ConfigError, match=message) as e:
            parse_tf_config(raw)
        assert "\n" not in str(e.value)


@pytest.mark.pure
def test_a_pods_task_gets_the_token_and_tls_ca_of_the_control_plane(tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    tls = {"tls_cert": "/pki/chief.pem", "tls_key": "/pki/chief.key", "tls_ca": "/pki/ca.pem"}
    spec = {"chief": ["demo-chief-0:2222"], "ps": ["demo-ps-0:2222"], "worker": ["demo-worker-0:2222"]}
    config = config_for_tf_config({"cluster": {"token_file": str(tmp_path / "token"), **tls}}, spec, "demo-chief-0:2229")
    assert shared_control_env(config) == {
        "PSTRAIN_CONTROL": "demo-chief-0:2229",
        "PSTRAIN_HEARTBEAT_INTERVAL": "2.0",
        "PSTRAIN_HEARTBEAT_TIMEOUT": "10.0",
        "PSTRAIN_REGISTER_TIMEOUT": "60.0",
        "PSTRAIN_TOKEN": "s3cret",
        "PSTRAIN_TLS_CA": "/pki/ca.pem",
    }


@pytest.mark.cluster
def test_task_without_token_fails_in_one_line(tmp_path):
    env = {"TF_CONFIG": operator.tf_config(tfjob_of(render(tmp_path)), "Worker", 0), "PSTRAIN_TOKEN": ""}
    result = run_pstrain(["task", "--control-port", "2229"], env=env, timeout=120)
    assert result.returncode == 2
    assert result.output.strip().splitlines() == [
        "pstrain: error: --token-file: no token; pass --token-file or set PSTRAIN_TOKEN to the cluster's shared token"
    ]


@pytest.mark.cluster
def test_tasks_register_again_with_a_restarted_chief():
    """A chief pod restarted by OnFailure serves a new, empty control plane at the same address:
    the ps and worker pods learn from its heartbeat replies that it does not know them, and join it."""
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    creds = Credentials("t")

    def control_plane():
        registry = Registry({("chief", 0): "h:1", ("worker", 0): "h:3"}, local_versions(), heartbeat_timeout=5.0)
        server, _ = serve(ControlService(registry, 0.2, lambda reason: None, lambda hosts: ({}, [])), address, creds)
        return registry, server

    first, server = control_plane()
    agent = Agent(address, creds, "worker", 0, "h:3", heartbeat_interval=0.2, heartbeat_timeout=5.0)
    stops: list = []
    try:
        agent.register(["CPU:0"], deadline_s=10)
        agent.start(on_stop=lambda reason, lost: stops.append(reason))
        assert first.knows(("worker", 0))
        server.stop(grace=0).wait()
        second, server = control_plane()
        deadline = time.monotonic() + 10
        while not second.knows(("worker", 0)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert second.knows(("worker", 0)) and second.missing() == [(("chief", 0), "h:1")]
        assert stops == []
    finally:
        agent.close()
        server.stop(grace=0)


# 3. End to end: a pod per network namespace.

WHY_NOT = can_create_namespaces()
PODS = (("Chief", 0), ("PS", 0), ("Worker", 0), ("Worker", 1))


def pod_filesystem(root: Path, tfjob: dict, config_map: dict, rtype: str, pvc: Path) -> Path:
    """The container's working dir under `root`, with the manifest's volumes mounted in it."""
    spec = tfjob["spec"]["tfReplicaSpecs"][rtype]["template"]["spec"]
    [container] = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    workdir = Path(container["workingDir"])
    for mount in container["volumeMounts"]:
        target = root / Path(mount["mountPath"]).relative_to(workdir)
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            assert volume["configMap"]["name"] == config_map["metadata"]["name"]
            target.mkdir(parents=True)
            for name, text in config_map["data"].items():
                (target / name).write_text(text)
        else:
            assert volume["persistentVolumeClaim"]["claimName"] == "demo-runs"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(pvc)
    return root


class Kubelet:
    """Runs each pod's container command in its namespace and, as restartPolicy OnFailure asks,
    starts it again when it exits non-zero (at most `max_restarts` times); tracks every process."""

    def __init__(self, tmp_path: Path, hosts: dict, tfjob: dict, config_map: dict, max_restarts: int = 3):
        self.tmp_path, self.hosts, self.tfjob, self.config_map = tmp_path, hosts, tfjob, config_map
        self.max_restarts = max_restarts
        self.processes: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}
        self.seen: set[int] = set()
        (tmp_path / "pvc").mkdir()

    def start(self, rtype: str, index: int) -> None:
        pod = f"{rtype.lower()}-{index}"
        root = self.tmp_path / "pods" / pod
        if not root.exists():
            pod_filesystem(root, self.tfjob, self.config_map, rtype, self.tmp_path / "pvc")
        container = self.tfjob["spec"]["tfReplicaSpecs"][rtype]["template"]["spec"]["containers"][0]
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(root)}
        env["HOSTNAME"] = operator.gen_general_name(self.tfjob["metadata"]["name"], rtype, index)
        env.update(operator.pod_env(self.tfjob, rtype, index, SECRETS))
        log = open(self.tmp_path / f"{pod}.out", "a")
        command = self.hosts[pod].command(container["command"])
        self.processes[pod] = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.seen.add(self.processes[pod].pid)

    def run(self, during=None, timeout: float = 300) -> dict[str, int]:
        """Until every pod has exited 0 or used up its restarts; returns the last exit codes."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                for pod, p in list(self.processes.items()):
                    self.seen |= descendant_pids([p.pid])
                    if p.poll() not in (None, 0) and self.restarts.get(pod, 0) < self.max_restarts:
                        self.restarts[pod] = self.restarts.get(pod, 0) + 1
                        rtype = {"chief": "Chief", "ps": "PS", "worker": "Worker"}[pod.split("-")[0]]
                        self.start(rtype, int(pod.split("-")[1]))
                if all(p.poll() is not None for p in self.processes.values()):
                    break
                if during:
                    during(self)
                time.sleep(0.2)
        finally:
            for p in self.processes.values():
                if p.poll() is None:
                    p.kill()
                p.wait()
            for p in alive(self.seen):
                p.kill()
        return {pod: p.returncode for pod, p in self.processes.items()}

    def output(self, pod: str) -> str:
        return (self.tmp_path / f"{pod}.out").read_text()


@pytest.mark.netns
@pytest.mark.skipif(bool(WHY_NOT), reason=f"cannot create network namespaces here: {WHY_NOT}")
def test_tfjob_end_to_end_one_namespace_per_pod_with_a_chief_restart(tmp_path):
    """The rendered pods train to the standalone model; the chief pod is killed once mid-run (as
    a node failure would) and restarted as OnFailure does: it resumes from its checkpoint on the
    claim and the running ps and worker pods register with it again."""
    documents = render(tmp_path, "--worker-gpus", "0", steps=60)
    tfjob, config_map = tfjob_of(documents), next(d for d in documents if d["kind"] == "ConfigMap")
    names = {f"{rtype.lower()}-{i}": operator.gen_general_name("demo", rtype, i) for rtype, i in PODS}
    members = {pod: [f"{service}.ml.svc", service] for pod, service in names.items()}
    run_dir = tmp_path / "pvc" / "demo"
    killed: list[int] = []

    def kill_chief_once(kubelet: Kubelet) -> None:
        if not killed and step_lines(run_dir) >= 15:
            chief = kubelet.processes["chief-0"]
            chief.kill()
            killed.append(step_lines(run_dir))

    with lan("pstk8s-", members, "10.252.7") as hosts:
        kubelet = Kubelet(tmp_path, hosts, tfjob, config_map)
        for rtype, index in PODS:
            kubelet.start(rtype, index)
        codes = kubelet.run(during=kill_chief_once)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    outputs = {pod: kubelet.output(pod) for pod in kubelet.processes}
    detail = f"{codes} restarts {kubelet.restarts}\n" + "\n".join(f"--- {k}\n{v[-3000:]}" for k, v in outputs.items())
    assert codes == dict.fromkeys(names, 0), detail
    assert killed and kubelet.restarts == {"chief-0": 1}, f"the chief pod alone was restarted, once: {detail}"
    assert_no_orphans(Result(0, "", kubelet.seen))
    assert all(h.namespace in listed for h in hosts.values()), "sanity: the namespaces existed while the pods ran"
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(h.namespace in after for h in hosts.values()) and not any(
        (Path("/etc/netns") / h.namespace).exists() for h in hosts.values()
    ), "the test removes its namespaces"
    records, done = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(60)) and done is not None
    assert_both_workers_each_step(records, starts=2)  # both worker pods; the chief pod started twice
    assert "resumed" in (run_dir / "logs" / "chief-0.log").read_text()
    for pod in ("ps-0", "worker-0", "worker-1"):
        assert "registered with the control plane at demo-chief-0.ml.svc:2229" in outputs[pod]
        assert "does not know this task; registering again" in outputs[pod], f"{pod} joined the restarted chief"
    reference = tmp_path / "standalone"
    result = run_pstrain(["train", "--standalone", "--run-dir", str(reference), "--steps", "60"])
    assert result.returncode == 0, result.output
    features = digits.eval_data()[0]
    np.testing.assert_allclose(predictions(run_dir, features), predictions(reference, features), atol=1e-4, rtol=0)
