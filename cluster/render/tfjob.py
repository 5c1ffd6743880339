"""`pstrain render tfjob`: a Kubeflow TFJob (kubeflow.org/v1) for the config's cluster. Pure.

Two documents: a ConfigMap holding the pod config (`cluster.toml`) and the TFJob. Every pod runs
the same container command, `pstrain task`, which serves the role the operator's TF_CONFIG names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from cluster.config import Config, ConfigError
from cluster.render import pod_config_toml
from cluster.task_setup import COMMON_ENV
from cluster.taskenv import DEFAULT_CONTROL_PORT, TOKEN_ENV

TF_PORT = 2222  # the operator's default; its TF_CONFIG uses the container port named tfjob-port
WORKDIR = "/pstrain"
CONFIG_DIR = "config"  # the ConfigMap, under WORKDIR
RUNS_DIR = "runs"  # the run-dir volume (chief only), under WORKDIR
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True)
class TFJobOptions:
    image: str
    name: str = "pstrain"
    namespace: str = "default"
    token_secret: str = ""  # default <name>-token, key "token"
    run_dir_claim: str = ""  # default <name>-runs
    control_port: int = DEFAULT_CONTROL_PORT
    gpus_per_pod: int = 1  # nvidia.com/gpu per worker pod (0: CPU workers); the flag --worker-gpus
    status_from: str = ""  # KEY=VALUE: pods with this label (same namespace) may reach the control port too

    @property
    def secret(self) -> str:
        return self.token_secret or f"{self.name}-token"

    @property
    def claim(self) -> str:
        return self.run_dir_claim or f"{self.name}-runs"


def check_options(options: TFJobOptions) -> None:
    # The job name ends up in "<name>-worker-<i>" Service names (63 characters at most).
    if not DNS_1035.fullmatch(options.name) or len(options.name) > 40:
        raise ConfigError(f"--name: {options.name!r} is not a DNS-1035 label of at most 40 characters; use e.g. pstrain-digits")
    names = (("--namespace", options.namespace), ("--token-secret", options.secret), ("--run-dir-claim", options.claim))
    for flag, value in names:
        if not DNS_1123_LABEL.fullmatch(value) or len(value) > 63:
            raise ConfigError(f"{flag}: {value!r} is not a valid Kubernetes name; use lower-case letters, digits and '-'")
    if not options.image.strip():
        raise ConfigError("--image: empty; give the container image that has pstrain installed")
    if options.control_port in (TF_PORT,) or not 0 < options.control_port <= 65535:
        raise ConfigError(f"--control-port: {options.control_port} must be a port 1-65535 other than {TF_PORT}")
    key, _, value = options.status_from.partition("=")
    if options.status_from and not (key and value and DNS_1123_LABEL.fullmatch(value.lower())):
        raise ConfigError(f"--status-from: {options.status_from!r}; give a pod label as KEY=VALUE, e.g. role=pstrain-status")
    if options.gpus_per_pod not in (0, 1):
        raise ConfigError(f"--worker-gpus: {options.gpus_per_pod}; pstrain pins one GPU per worker, give 1 (or 0 for CPU)")


def run_dir(options: TFJobOptions) -> str:
    return f"{RUNS_DIR}/{options.name}"


def container(options: TFJobOptions, role: str) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": options.secret, "key": "token"}}},
        *({"name": k, "value": v} for k, v in COMMON_ENV.items()),
    ]
    if role != "Worker" or not options.gpus_per_pod:
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"})  # CUDA images show every GPU otherwise
    mounts = [{"name": "config", "mountPath": f"{WORKDIR}/{CONFIG_DIR}", "readOnly": True}]
    if role == "Chief":
        mounts.append({"name": "runs", "mountPath": f"{WORKDIR}/{RUNS_DIR}"})
    spec: dict[str, Any] = {
        "name": "tensorflow",
        "image": options.image,
        "workingDir": WORKDIR,
        "command": ["pstrain", "task", "--config", f"{CONFIG_DIR}/cluster.toml", "--control-port", str(options.control_port)],
        "ports": [
            {"name": "tfjob-port", "containerPort": TF_PORT, "protocol": "TCP"},
            {"name": "pstrain-control", "containerPort": options.control_port, "protocol": "TCP"},
        ],
        "env": env,
        "volumeMounts": mounts,
    }
    if role == "Worker" and options.gpus_per_pod:
        spec["resources"] = {"limits": {"nvidia.com/gpu": options.gpus_per_pod}}
    return spec


def replica(options: TFJobOptions, role: str, count: int) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": f"{options.name}-config"}}]
    if role == "Chief":  # only the chief writes the run dir, so a ReadWriteOnce claim suffices
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": options.claim}})
    labels = {**job_labels(options), "app.kubernetes.io/component": role.lower()}
    return {
        "replicas": count,
        "restartPolicy": "OnFailure",
        "template": {"metadata": {"labels": labels}, "spec": {"containers": [container(options, role)], "volumes": volumes}},
    }


def job_labels(options: TFJobOptions) -> dict[str, str]:
    """The labels every pod of this job carries: what its NetworkPolicy admits."""
    return {"app.kubernetes.io/name": "pstrain", "app.kubernetes.io/instance": options.name}


def network_policy(options: TFJobOptions, meta: dict[str, Any]) -> dict[str, Any]:
    """Close the pods' doors: TF's servers (unauthenticated; they run any op sent to them) and the control
    plane admit the job's own pods only, the control port also pods labelled `status_from`. A cluster
    whose network plugin does not enforce NetworkPolicy ignores it (docs/kubernetes.md)."""
    own = {"podSelector": {"matchLabels": job_labels(options)}}
    tcp = [{"protocol": "TCP", "port": port} for port in (TF_PORT, options.control_port)]
    ingress: list[dict[str, Any]] = [{"from": [own], "ports": tcp}]
    if options.status_from:
        key, _, value = options.status_from.partition("=")
        ingress.append({"from": [{"podSelector": {"matchLabels": {key: value}}}], "ports": tcp[1:]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {**meta, "name": f"{options.name}-doors"},
        "spec": {"podSelector": own["podSelector"], "policyTypes": ["Ingress"], "ingress": ingress},
    }


def render_tfjob(config: Config, options: TFJobOptions) -> list[dict[str, Any]]:
    """[ConfigMap, TFJob, NetworkPolicy] for `config`'s counts of ps and workers."""
    check_options(options)
    if config.cluster.tls_cert or config.cluster.tls_ca:
        raise ConfigError("cluster.tls_cert: TLS files are not carried into pods; remove the tls_* fields to render a TFJob")
    meta = {"name": options.name, "namespace": options.namespace, "labels": {"app.kubernetes.io/name": "pstrain"}}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**meta, "name": f"{options.name}-config"},
        "data": {"cluster.toml": pod_config_toml(config, run_dir(options))},
    }
    tfjob = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": meta,
        "spec": {
            "runPolicy": {"cleanPodPolicy": "Running"},
            "tfReplicaSpecs": {
                "Chief": replica(options, "Chief", 1),
                "PS": replica(options, "PS", len(config.cluster.ps)),
                "Worker": replica(options, "Worker", len(config.cluster.workers)),
            },
        },
    }
    return [config_map, tfjob, network_policy(options, meta)]


def to_yaml(documents: list[dict[str, Any]]) -> str:
    """YAML documents; multi-line strings (the pod config) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return yaml.dump_all(documents, Dumper=Dumper, sort_keys=False, default_flow_style=False)
