"""TF_CONFIG: the only module that parses or writes it. Pure, but for `training_resolver`.

An injected TF_CONFIG (Kubeflow TFJob, or any scheduler that sets it) -> pstrain's cluster; what a
`pstrain server` serves; TF_CONFIG as pstrain writes it for each task it starts; and the chief's
cluster resolver over the training tasks (TensorFlow imported only there).

The operator writes lower-cased task types (``chief`` or its old alias ``master``, ``ps``,
``worker``; an ``evaluator`` is not part of the training cluster), addresses
``<job>-<type>-<i>.<namespace>.svc:<port>`` and ``"environment": "cloud"``. The control plane
runs beside the chief, on the chief's host at ``control_port``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from cluster.config import ClusterConfig, Config, ConfigError, format_address, parse_address, resolve

ROLES = ("chief", "ps", "worker")
# Config fields that TF_CONFIG and the pod decide instead of the file.
ADDRESS_FIELDS = ("host", "chief", "ps", "workers", "control", "worker_gpus")


_SHAPE_ERRORS = (ValueError, KeyError, TypeError, AttributeError)
TF_CONFIG_ENV = "TF_CONFIG"


def tf_config_text(env: Mapping[str, str] | None = None) -> str | None:
    """TF_CONFIG's text as set in `env` (default: this process's environment); None where it is unset.
    The only read of TF_CONFIG from an environment (TensorFlow's own resolver aside: `training_resolver`)."""
    return (os.environ if env is None else env).get(TF_CONFIG_ENV)


def forget_tf_config() -> None:
    """Drop TF_CONFIG from this process's environment: a run without a cluster must not join one."""
    os.environ.pop(TF_CONFIG_ENV, None)


def _read(raw: str) -> tuple[dict[str, Any], str, int]:
    """(cluster as given, task type as given, task index); one of _SHAPE_ERRORS where the text is not that."""
    config = json.loads(raw)
    cluster, task = dict(config["cluster"]), config["task"]
    return cluster, str(task["type"]), int(task["index"])


def named_task_type(raw: str | None) -> str | None:
    """The task type TF_CONFIG names, None where it is unset or unreadable (its reader reports that)."""
    try:
        return _read(raw)[1] if raw else None
    except _SHAPE_ERRORS:
        return None


def named_task(raw: str | None) -> tuple[str, int] | None:
    """(task type, task index) that TF_CONFIG names, None where it is unset or unreadable."""
    try:
        return _read(raw)[1:] if raw else None
    except _SHAPE_ERRORS:
        return None


def chief_address(raw: str | None) -> str:
    """The chief's address in TF_CONFIG's cluster ("" where there is none)."""
    try:
        return str(_read(raw)[0].get("chief", [""])[0]) if raw else ""
    except (*_SHAPE_ERRORS, IndexError):
        return ""


def server_task(raw: str | None) -> tuple[dict[str, Any], str, int]:
    """What `pstrain server` serves: (cluster as given, "worker" or "ps", index), with one-line errors."""
    if not raw:
        raise ConfigError("pstrain server: TF_CONFIG is not set; the launcher sets it, or set it as TFJob does")
    try:
        cluster, kind, index = _read(raw)
    except _SHAPE_ERRORS as e:
        raise ConfigError(
            f"pstrain server: TF_CONFIG is invalid ({e!r}); expect {{cluster: ..., task: {{type, index}}}}"
        ) from None
    if kind not in ("worker", "ps"):
        raise ConfigError(f"pstrain server: TF_CONFIG task type {kind!r} is not 'worker' or 'ps'")
    if index >= len(cluster.get(kind, [])):
        raise ConfigError(f"pstrain server: TF_CONFIG task {kind}:{index} is missing from its cluster")
    return cluster, kind, index


def parse_tf_config(raw: str | None) -> tuple[dict[str, list[str]], str, int]:
    """(cluster spec with keys chief/ps/worker, task type, task index) from TF_CONFIG's text."""
    if not raw:
        raise ConfigError("TF_CONFIG: not set; the TFJob operator injects it, or set it as it does")
    try:
        cluster, task_type, index = _read(raw)
        task_type = task_type.lower()
    except _SHAPE_ERRORS as e:
        raise ConfigError(f"TF_CONFIG: invalid ({e!r}); expect {{cluster: {{...}}, task: {{type, index}}}}") from None
    spec: dict[str, list[str]] = {}
    for key, addresses in cluster.items():
        role = {"master": "chief"}.get(key.lower(), key.lower())
        if role == "evaluator":
            continue
        if role not in ROLES:
            raise ConfigError(f"TF_CONFIG: cluster has task type {key!r}; pstrain runs chief (or master), ps and worker")
        if role in spec:
            raise ConfigError("TF_CONFIG: cluster has both chief and master; give the job one Chief")
        if not isinstance(addresses, list) or not addresses:
            raise ConfigError(f"TF_CONFIG: cluster.{key} must be a non-empty list of 'host:port', got {addresses!r}")
        for i, address in enumerate(addresses):
            parse_address(f"TF_CONFIG cluster.{key}[{i}]", address)
        spec[role] = list(addresses)
    missing = [role for role in ROLES if role not in spec]
    if missing:
        raise ConfigError(f"TF_CONFIG: cluster has no {', '.join(missing)}; a pstrain job needs a Chief, PS and Workers")
    if len(spec["chief"]) != 1:
        raise ConfigError(f"TF_CONFIG: cluster has {len(spec['chief'])} chiefs; give the job exactly one Chief")
    task_type = {"master": "chief"}.get(task_type, task_type)
    if task_type not in ROLES:
        raise ConfigError(f"TF_CONFIG: task type {task_type!r} is not chief, ps or worker; pstrain does not run it")
    if not 0 <= index < len(spec[task_type]):
        raise ConfigError(f"TF_CONFIG: task {task_type}:{index} is not in its cluster ({len(spec[task_type])} {task_type})")
    return spec, task_type, index


def control_address(spec: dict[str, list[str]], control_port: int) -> str:
    """The control plane: on the chief's host, at `control_port`."""
    if not 0 < control_port <= 65535:
        raise ConfigError(f"--control-port: {control_port} is not a port 1-65535; give the chief's control-plane port")
    return format_address(parse_address("TF_CONFIG cluster.chief[0]", spec["chief"][0])[0], control_port)


def config_for_tf_config(raw: dict[str, Any], spec: dict[str, list[str]], control: str) -> Config:
    """The config file's settings, with the cluster's addresses from TF_CONFIG.

    The worker count of TF_CONFIG decides `replicas_to_aggregate` where the file leaves it out, as
    the counts of a config file do; GPUs come from the pod (its device plugin), never an index.
    """
    cluster_raw = {k: v for k, v in dict(raw.get("cluster", {})).items() if k not in ADDRESS_FIELDS}
    resolved = resolve({**raw, "cluster": {**cluster_raw, "workers": len(spec["worker"]), "ps": len(spec["ps"])}})
    cluster: ClusterConfig = replace(
        resolved.cluster,
        chief=spec["chief"][0],
        ps=tuple(spec["ps"]),
        workers=tuple(spec["worker"]),
        worker_gpus=tuple(None for _ in spec["worker"]),
        control=control,
    )
    return replace(resolved, cluster=cluster)


def task_tf_config(spec: dict[str, list[str]], task_type: str, index: int) -> str:
    """TF_CONFIG as pstrain writes it (chief/ps/worker keys), for the task's own TF server."""
    return json.dumps({"cluster": spec, "task": {"type": task_type, "index": index}})


def training_cluster(cluster: dict) -> dict:
    """The tasks that train: TF_CONFIG's cluster without an `evaluator` (as Kubeflow may list one). The
    evaluator runs no TF server for the chief; left in, connecting to the cluster would wait for it."""
    return {job: tasks for job, tasks in cluster.items() if job != "evaluator"}


def training_resolver():
    """TF_CONFIG's resolver (a tf.distribute ClusterResolver), with only the training tasks in its cluster."""
    import tensorflow as tf  # only the chief resolves; the rest of this module stays pure

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = tf.train.ClusterSpec(training_cluster(resolver.cluster_spec().as_dict()))
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type=resolver.task_type, task_id=resolver.task_id, rpc_layer=resolver.rpc_layer or "grpc"
    )
