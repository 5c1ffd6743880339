"""Close a launch's doors (cluster/doors.py decides): for a local cluster, a private network namespace
for its tasks and the control plane on a unix socket; else say plainly what stays open."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from cluster import doors
from cluster.config import ClusterConfig, ConfigError
from cluster.launch.netns import PrivateNetwork, Unavailable, describe, kinds_to_try


@dataclass(frozen=True)
class Doors:
    """How a launch runs: its cluster (the control target a closed one serves on), the namespace its
    tasks start in (None: the host's network) and the console line that says so (a warning when open)."""

    cluster: ClusterConfig
    network: PrivateNetwork | None
    line: str

    @property
    def open(self) -> bool:
        return self.network is None


@contextlib.contextmanager
def closed(cluster: ClusterConfig, local_tasks: set | None, run_dir: Path, kinds: tuple | None = None) -> Iterator[Doors]:
    """The doors of this launch, for as long as it runs; a refusal (ConfigError) where a local cluster
    cannot be closed and `allow_open_ports` is off. Leaves nothing behind (the socket is removed).
    `kinds`: the namespaces to try (default: those this user may make, netns.kinds_to_try)."""
    if not doors.closable_by_namespace(cluster, local_tasks):
        yield Doors(cluster, None, doors.remote_line())
        return
    try:
        network = PrivateNetwork.make(kinds_to_try(os.geteuid()) if kinds is None else kinds)
    except Unavailable as e:
        if not cluster.allow_open_ports:
            raise ConfigError(doors.refusal(str(e))) from None
        yield Doors(cluster, None, doors.open_line())
        return
    path = doors.socket_in_run_dir(run_dir)
    spare = None if path else Path(tempfile.mkdtemp(prefix="pstrain-"))  # (private): the run dir's path is too long
    path = path or spare / doors.SOCKET_NAME
    try:
        path.unlink(missing_ok=True)  # a socket a killed launcher left
        control = doors.unix_target(path)
        yield Doors(replace(cluster, control=control), network, doors.closed_line(describe(network.kind), control))
    finally:
        network.close()
        path.unlink(missing_ok=True)
        if spare is not None:
            shutil.rmtree(spare, ignore_errors=True)
