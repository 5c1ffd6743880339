"""`pstrain task`: one entry point for every pod of a TFJob (or any node given a TF_CONFIG).

The injected TF_CONFIG names the role. The chief serves the control plane on all interfaces at
`control_port` and trains, starting no servers of its own: every ps and worker is another pod that
registers. A ps or worker serves its TF server and registers with the control plane on the chief's
host at the same port.
"""

from __future__ import annotations

import os
from pathlib import Path

from cluster.config import ConfigError, load_toml
from cluster.control.agent import CONTROL_ENV
from cluster.launch.launcher import launch, shared_control_env
from cluster.plan import COMMON_ENV
from cluster.tfconfig import config_for_tf_config, control_address, parse_tf_config, task_tf_config

DEFAULT_CONTROL_PORT = 2229


def run_task(config_path: str, control_port: int = DEFAULT_CONTROL_PORT) -> int:
    """Serve the role TF_CONFIG names; returns the exit code (the chief's, for the chief)."""
    raw = load_toml(config_path) if config_path else {}
    spec, task_type, index = parse_tf_config(os.environ.get("TF_CONFIG"))
    control = os.environ.get(CONTROL_ENV) or control_address(spec, control_port)
    config = config_for_tf_config(raw, spec, control)
    env = shared_control_env(config.cluster)  # every pod needs the shared token (none is generated) and TLS CA
    for name, value in COMMON_ENV.items():
        os.environ.setdefault(name, value)
    if task_type == "chief":
        if not config.train.run_dir:
            raise ConfigError(f"train.run_dir: {config_path or 'the config'} sets none; give the chief a run dir on its volume")
        Path(config.train.run_dir).mkdir(parents=True, exist_ok=True)
        return launch(config, local_tasks=set(), control_bind=f"0.0.0.0:{control.rpartition(':')[2]}")
    from worker.server import serve

    os.environ.update({"TF_CONFIG": task_tf_config(spec, task_type, index), **env})
    os.environ.setdefault("PSTRAIN_REGISTER_TIMEOUT", str(config.train.startup_timeout))
    return serve()
