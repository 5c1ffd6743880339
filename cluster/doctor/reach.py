"""Who can reach a running run (`pstrain doctor --run-dir`): each listening port of its processes and
the node rules that close its TF ports. Pure checks over gathered facts (cluster/doctor/run.py)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster import rulesets
from cluster.doctor.checks import Check


def doors(listening: list[tuple[int, str, str, int, str]], control: str) -> list[Check]:
    """Where a run's doors are: `listening` (pid, command, address as bound, port, who reaches it) for
    every listening TCP socket of the run; `control`, its control target. A TF port anyone reaches is a
    WARN; the control plane's port (token-checked) is not."""
    out = []
    control_port = int(control.rpartition(":")[2]) if control and not control.startswith("unix:") else None
    if control.startswith("unix:"):
        out.append(Check("INFO", "doors.control", f"{control}: a unix socket, for users who may write it (and the token)"))
    for pid, command, address, port, reach in listening:
        what = "pstrain's control plane (token-checked)" if port == control_port else f"{command} (pid {pid})"
        level = "WARN" if reach.startswith("any host") and port != control_port else "INFO"
        fix = "close it: a local cluster, or root and nftables on each node (README: Security)" if level == "WARN" else ""
        bound = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        out.append(Check(level, f"doors.{port}", f"{what} listens on {bound}; reached by {reach}", fix))
    if not listening:
        out.append(Check("INFO", "doors", "no process of the run listens on a TCP port (is it running?)"))
    return out


@dataclass(frozen=True)
class Guardian:
    """A run's node-rules guardian (cluster/launch/firewall.py): its rules' tool and name, the TF ports
    they close, and whether the tool lists them now (None: this process may not list them)."""

    pid: int
    tool: str
    name: str
    ports: tuple[int, ...]
    present: bool | None

    @property
    def what(self) -> str:
        return f"{rulesets.TOOLS[self.tool]} {self.name}"


def guarded(reach: str, port: int, guardians: list[Guardian]) -> str:
    """Who reaches `port`, with the run's node rules in place: the cluster's hosts only."""
    for g in guardians:
        if g.present and port in g.ports and reach.startswith("any host"):
            return f"the cluster's hosts only ({g.what})"
    return reach


def node_rules(guardians: list[Guardian], control: str) -> list[Check]:
    """Whether the run's node rules are in place on this machine (`guardians`, among the run's
    processes); `control`, its control target (unix: a private namespace, which needs no rules)."""
    if control.startswith("unix:"):
        return []
    if not guardians:
        return [Check("INFO", "doors.rules", "no node rules of this run on this machine (its TF ports are as listed)")]
    out = []
    for g in guardians:
        what, ports = f"{g.what} (guardian pid {g.pid})", ", ".join(map(str, g.ports))
        if g.present is None:
            out.append(Check("INFO", "doors.rules", f"{what}: cannot list the {g.tool} rules here (not root)"))
        elif g.present:
            out.append(Check("INFO", "doors.rules", f"{what} in place: TF ports {ports} admit the cluster's hosts only"))
        else:
            fix = "something deleted them (a firewall reload?): stop the run and start it again to make them anew"
            out.append(Check("WARN", "doors.rules", f"{what} is gone while its run goes on: TF ports {ports} are open", fix))
    return out
