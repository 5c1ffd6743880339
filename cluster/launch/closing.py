"""Close a launch's or node's doors (cluster/doors.py decides): a local cluster's tasks in a private
network namespace with the control plane on a unix socket; on a machine of a multi-machine cluster,
nftables (or iptables) rules admitting the cluster's hosts only (cluster/launch/firewall.py); else a refusal, or
where pstrain cannot close them (Slurm as a user, a pod) a plain statement."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from cluster import doors, rulesets
from cluster.config import ClusterConfig, ConfigError
from cluster.launch import firewall
from cluster.launch.netns import PrivateNetwork, Unavailable, describe, kinds_to_try

WHERE = ("launch", "node", "slurm", "pod")  # who runs: a refusal for launch and node, a statement otherwise


@dataclass(frozen=True)
class Doors:
    """How a launch runs: its cluster (the control target a closed one serves on), the namespace its
    tasks start in (None: the host's network), the console line that says so, and whether it is open."""

    cluster: ClusterConfig
    network: PrivateNetwork | None
    line: str
    open: bool


@contextlib.contextmanager
def closed(
    cluster: ClusterConfig, local_tasks: set | None, run_dir: Path, ports: list[int], where: str = "launch", kinds=None
) -> Iterator[Doors]:
    """The doors of this launch, for as long as it runs. `ports`: the TF ports of the tasks it runs on
    this machine (chief included); `kinds`: the namespaces to try (default: netns.kinds_to_try).
    A ConfigError refuses what cannot be closed (unless `allow_open_ports`). Leaves nothing behind."""
    if not doors.closable_by_namespace(cluster, local_tasks):
        if where == "pod":
            yield Doors(cluster, None, doors.unclosed_line("pods: closed by the TFJob's NetworkPolicy where enforced"), True)
            return
        with node_rules(cluster, ports, where) as (line, is_open):
            yield Doors(cluster, None, line, is_open)
        return
    if not cluster.private_network:  # asked for the host's network: open ports, accepted or refused
        if not cluster.allow_open_ports:
            raise ConfigError(doors.no_private_network_refusal())
        yield Doors(cluster, None, doors.open_line(), True)
        return
    with contextlib.ExitStack() as held:  # each thing made is registered for removal before the next
        try:
            network = PrivateNetwork.make(kinds_to_try(os.geteuid()) if kinds is None else kinds)
        except Unavailable as e:
            if not cluster.allow_open_ports:
                raise ConfigError(doors.refusal(str(e))) from None
            yield Doors(cluster, None, doors.open_line(), True)
            return
        held.callback(network.close)
        path = doors.socket_in_run_dir(run_dir)
        if path is None:  # the run dir's path is too long for a socket: a private folder instead
            spare = Path(tempfile.mkdtemp(prefix="pstrain-"))
            held.callback(shutil.rmtree, spare, ignore_errors=True)
            path = spare / doors.SOCKET_NAME
        held.callback(path.unlink, missing_ok=True)
        path.unlink(missing_ok=True)  # a socket a killed launcher left
        control = doors.unix_target(path)
        yield Doors(replace(cluster, control=control), network, doors.closed_line(describe(network.kind), control), False)


@contextlib.contextmanager
def node_rules(cluster: ClusterConfig, ports: list[int], where: str) -> Iterator[tuple[str, bool]]:
    """This machine's TF `ports` closed to all but the cluster's hosts while the block runs; yields
    (console line, open). Where the rules cannot be made: a refusal for `launch` and `node` (unless
    `allow_open_ports`), a plain statement for Slurm."""
    tool, why = firewall.choose()
    if tool:
        try:
            peers = firewall.peer_addresses(cluster)
            with firewall.rules(tool, ports, peers) as name:
                yield doors.rules_line(ports, peers, rulesets.TOOLS[tool], name), False
            return
        except firewall.Unclosable as e:
            why = str(e)
    if where in ("launch", "node") and not cluster.allow_open_ports:
        raise ConfigError(doors.node_refusal(why))
    yield (doors.open_line() if cluster.allow_open_ports else doors.unclosed_line(why)), True
