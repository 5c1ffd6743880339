"""Test-only: what Kubeflow's training-operator (v1.9.0) and its API server do with a TFJob.

- the CRD's openAPIV3Schema made strict (unknown fields refused) and the admission webhook's rules
  that the schema does not check (shared/k8s/README.md);
- a port of how the operator names each replica's pod and headless Service and builds its
  TF_CONFIG (genClusterSpec / genTFConfigJSONStr / isDistributed, GetPortFromTFJob) and which
  container it injects it into.
"""

from __future__ import annotations

import copy
import gzip
import json
import re
from pathlib import Path
from typing import Any

import yaml

CRD = Path(__file__).parent / "data" / "kubeflow.org_tfjobs.yaml.gz"
DEFAULT_CONTAINER = "tensorflow"
DEFAULT_PORT_NAME = "tfjob-port"
DEFAULT_PORT = 2222
REPLICA_TYPES = ("Chief", "Master", "PS", "Worker", "Evaluator")
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def crd_schema() -> dict[str, Any]:
    with gzip.open(CRD, "rt") as f:
        crd = yaml.safe_load(f)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def strict(schema: Any) -> Any:
    """Unknown fields refused: additionalProperties false wherever properties are listed, unless
    the schema keeps unknown fields (x-kubernetes-preserve-unknown-fields) or says otherwise."""
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for key, value in node.items():
                if key != "properties":
                    visit(value)
                else:
                    for sub in value.values():
                        visit(sub)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    visit(schema)
    return schema


def webhook_errors(tfjob: dict[str, Any]) -> list[str]:
    """The operator's admission webhook checks (validateTFJob), plus what its API needs of names."""
    errors = []
    name = tfjob.get("metadata", {}).get("name", "")
    if not DNS_1035.fullmatch(name) or len(name) > 63:
        errors.append(f"metadata.name {name!r} is not a DNS-1035 label")
    specs = tfjob.get("spec", {}).get("tfReplicaSpecs") or {}
    if not specs:
        errors.append("spec.tfReplicaSpecs is empty")
    if sum(1 for t in ("Chief", "Master") if t in specs) > 1 or any(
        specs.get(t, {}).get("replicas", 1) > 1 for t in ("Chief", "Master")
    ):
        errors.append("more than one Chief/Master")
    for rtype, spec in specs.items():
        if rtype not in REPLICA_TYPES:
            errors.append(f"{rtype}: not a TFJob replica type")
        if spec.get("restartPolicy", "Never") not in RESTART_POLICIES:
            errors.append(f"{rtype}: restartPolicy {spec.get('restartPolicy')!r} is not one of {RESTART_POLICIES}")
        containers = spec.get("template", {}).get("spec", {}).get("containers", [])
        named = [c for c in containers if c.get("name") == DEFAULT_CONTAINER]
        if not named:
            errors.append(f"{rtype}: no container named {DEFAULT_CONTAINER}")
        for c in containers:
            if not c.get("image"):
                errors.append(f"{rtype}: container {c.get('name')!r} has no image")
    return errors


def gen_general_name(job: str, rtype: str, index: int) -> str:
    return f"{job}-{rtype.lower()}-{index}".replace("/", "-")


def port_of(tfjob: dict[str, Any], rtype: str) -> int:
    """GetPortFromTFJob: the tensorflow container's port named tfjob-port, else 2222."""
    for container in tfjob["spec"]["tfReplicaSpecs"][rtype]["template"]["spec"]["containers"]:
        if container["name"] == DEFAULT_CONTAINER:
            for port in container.get("ports", []):
                if port.get("name") == DEFAULT_PORT_NAME:
                    return int(port["containerPort"])
    return DEFAULT_PORT


def cluster_spec(tfjob: dict[str, Any]) -> dict[str, list[str]]:
    """genClusterSpec: every replica type but Evaluator, lower-cased, one Service name per index."""
    name, namespace = tfjob["metadata"]["name"], tfjob["metadata"].get("namespace", "default")
    spec = {}
    for rtype, replica in tfjob["spec"]["tfReplicaSpecs"].items():
        if rtype == "Evaluator":
            continue
        port = port_of(tfjob, rtype)
        spec[rtype.lower()] = [
            f"{gen_general_name(name, rtype, i)}.{namespace}.svc:{port}" for i in range(replica.get("replicas", 1))
        ]
    return spec


def is_distributed(tfjob: dict[str, Any]) -> bool:
    return sum(r.get("replicas", 1) for r in tfjob["spec"]["tfReplicaSpecs"].values()) != 1


def tf_config(tfjob: dict[str, Any], rtype: str, index: int) -> str | None:
    """genTFConfigJSONStr (without enableDynamicWorker); None where the operator sets nothing."""
    if not is_distributed(tfjob):
        return None
    config = {"cluster": cluster_spec(tfjob), "task": {"type": rtype.lower(), "index": index}, "environment": "cloud"}
    return json.dumps(config, separators=(",", ":"))


def services(tfjob: dict[str, Any]) -> dict[str, dict[str, int]]:
    """One headless Service per replica: its name -> {port name: port} of the tensorflow container."""
    out = {}
    for rtype, replica in tfjob["spec"]["tfReplicaSpecs"].items():
        container = next(c for c in replica["template"]["spec"]["containers"] if c["name"] == DEFAULT_CONTAINER)
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if p.get("name")}
        for i in range(replica.get("replicas", 1)):
            out[gen_general_name(tfjob["metadata"]["name"], rtype, i)] = ports
    return out


def pod_env(tfjob: dict[str, Any], rtype: str, index: int, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The tensorflow container's environment as the kubelet gives it: the manifest's env (secret
    references filled from `secrets`) plus the operator's TF_CONFIG."""
    container = next(
        c for c in tfjob["spec"]["tfReplicaSpecs"][rtype]["template"]["spec"]["containers"] if c["name"] == DEFAULT_CONTAINER
    )
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
    config = tf_config(tfjob, rtype, index)
    if config is not None:
        env["TF_CONFIG"] = config
    return env
