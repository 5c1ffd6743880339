"""`pstrain task`: one entry point for every pod of a TFJob (or any node given a TF_CONFIG).

The injected TF_CONFIG names the role. The chief serves the control plane on all interfaces at
`control_port` and trains, starting no servers of its own: every ps and worker is another pod that
registers. A ps or worker serves its TF server and registers with the control plane on the chief's
host at the same port.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from cluster.config import Config, ConfigError
from cluster.launch.launcher import launch, shared_control_env
from cluster.rundir import RunDir
from cluster.task_setup import COMMON_ENV
from cluster.taskenv import DEFAULT_CONTROL_PORT, env_control
from cluster.tfconfig import TF_CONFIG_ENV, config_for_tf_config, control_address, parse_tf_config, task_tf_config, tf_config_text


def pod_env(
    raw: dict[str, Any], environ: Mapping[str, str], control_port: int = DEFAULT_CONTROL_PORT
) -> tuple[Config, str, dict[str, str]]:
    """(the pod's config, its task type, the environment a ps/worker pod serves with) from the pod
    config `raw` and the injected TF_CONFIG in `environ`; the same environment `pstrain launch` hands it."""
    spec, task_type, index = parse_tf_config(tf_config_text(environ))
    control = env_control(environ) or control_address(spec, control_port)
    config = config_for_tf_config(raw, spec, control)
    # every pod needs the shared token (none is generated) and TLS CA
    env = {TF_CONFIG_ENV: task_tf_config(spec, task_type, index), **shared_control_env(config)}
    return config, task_type, env


def run_task(config: Config, task_type: str, env: dict[str, str], layout: RunDir, config_path: str = "") -> int:
    """Serve the role TF_CONFIG names (`pod_env`'s answer); the chief launches in `layout`, the RunDir of
    `config.train.run_dir` on its volume. Returns the exit code (the chief's, for the chief)."""
    for name, value in COMMON_ENV.items():
        os.environ.setdefault(name, value)
    if task_type == "chief":
        if not config.train.run_dir:
            raise ConfigError(f"train.run_dir: {config_path or 'the config'} sets none; give the chief a run dir on its volume")
        layout.path.mkdir(parents=True, exist_ok=True)
        control = config.cluster.control
        return launch(config, layout, local_tasks=set(), control_bind=f"0.0.0.0:{control.rpartition(':')[2]}", where="pod")
    from worker.server import serve

    os.environ.update(env)
    return serve()
