"""The one two-host job the netns system tests run: hosts A and B (tests/netns.py), `pstrain launch` on
A and `pstrain node --chief A` on B, as docs/two-machines.md writes it.

The chief and its control plane are on A (ports 2220 and 2229); the ps and each worker on the host its
letter names (the ps on 2221, workers from 2222 up on each host). Each test says only what differs.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from tests.netns import Host

CHIEF_PORT, PS_PORT, WORKER_PORT, CONTROL_PORT = 2220, 2221, 2222, 2229


def toml_value(value: object) -> str:
    """A TOML value for a str, number, bool or list of them (a TOML basic string is a JSON string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value if isinstance(value, int | float) else str(value))


def two_host_config(
    hosts: dict[str, Host], token: Path, *, ps: str = "a", workers: str = "ab", cluster: dict | None = None, **train
) -> str:
    """cluster.toml's text for a job over `hosts` ({"a": A, "b": B}): the chief and control plane on A, the
    ps on host `ps`, a worker on each host `workers` lists ("ab": worker 0 on A, 1 on B; "aa": both on A),
    `token` the control plane's token file, heartbeats every 0.5 s; `cluster` adds or overrides [cluster]
    keys (heartbeat_timeout), `train` gives the [train] keys (run_dir, steps, ...)."""
    a = hosts["a"].address
    worker_addresses = [f"{hosts[h].address}:{WORKER_PORT + workers[:i].count(h)}" for i, h in enumerate(workers)]
    table = {
        "chief": f"{a}:{CHIEF_PORT}",
        "control": f"{a}:{CONTROL_PORT}",
        "ps": [f"{hosts[ps].address}:{PS_PORT}"],
        "workers": worker_addresses,
        "token_file": token,
        "heartbeat_interval": 0.5,
        **(cluster or {}),
    }
    lines = ["[cluster]", *(f"{k} = {toml_value(v)}" for k, v in table.items()), "", "[train]"]
    return "\n".join([*lines, *(f"{k} = {toml_value(v)}" for k, v in train.items())]) + "\n"


def write_two_host_job(tmp_path: Path, hosts: dict[str, Host], **options) -> tuple[Path, Path]:
    """A fresh token (tmp_path/token, kept when one is there) and tmp_path/cluster.toml (`two_host_config`
    with `options`); returns (config, token)."""
    token, config = tmp_path / "token", tmp_path / "cluster.toml"
    if not token.exists():
        token.write_text(secrets.token_urlsafe(16) + "\n")
    config.write_text(two_host_config(hosts, token, **options))
    return config, token


def node_argv(chief: Host, token: Path, log_dir: Path) -> list[str]:
    """`pstrain node`'s arguments on host B: register with A's control plane with `token`, logs in `log_dir`."""
    return ["node", "--chief", f"{chief.address}:{CONTROL_PORT}", "--token-file", str(token), "--log-dir", str(log_dir)]
