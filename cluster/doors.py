"""Who can reach a run's TensorFlow servers ("doors"), decided before any task starts. Pure.

TensorFlow's gRPC server listens on every interface (0.0.0.0) with insecure credentials whatever the
cluster spec says, and its eager service runs any op it is sent (reading and writing files, running
functions). pstrain closes these doors:
- a local cluster (every task on this machine's loopback, placed by `pstrain launch` itself) runs its
  tasks in a private network namespace (cluster/launch/netns.py): their ports exist only there, and the
  control plane is served on a unix socket (`unix:PATH`) that the tasks and the user's shell both reach;
- where no namespace can be made, the launch is refused in one line unless `allow_open_ports` accepts it;
- tasks on several machines are not closed by a namespace: the console and docs say so.
"""

from __future__ import annotations

from pathlib import Path

from cluster.config import ClusterConfig, ConfigError, is_loopback, parse_address, task_addresses

SOCKET_NAME = "control.sock"  # RUN_DIR/control.sock: a closed local cluster's control plane
MAX_UNIX_PATH = 107  # bytes of a socket path (sun_path holds 108 with its terminating NUL)
UNIX = "unix:"
ALLOW_FLAG = "--allow-open-ports"


def closable_by_namespace(cluster: ClusterConfig, local_tasks: set | None) -> bool:
    """Every task (chief, ps, workers) on loopback and started by this launcher: one private network
    namespace can hold them all, with nobody outside it to talk to."""
    if cluster.engine != "local" or local_tasks is not None:
        return False
    tasks = [(name, address) for name, address in task_addresses(cluster) if name != "cluster.control"]
    return all(is_loopback(parse_address(name, address)[0]) for name, address in tasks)


def socket_in_run_dir(run_dir: Path) -> Path | None:
    """RUN_DIR/control.sock (absolute), or None where that path is too long for a unix socket."""
    path = run_dir.absolute() / SOCKET_NAME
    return path if len(str(path).encode()) <= MAX_UNIX_PATH else None


def unix_target(path: Path) -> str:
    return f"{UNIX}{path}"


def is_unix_target(target: str) -> bool:
    return target.startswith(UNIX)


def check_control_target(name: str, target: str) -> None:
    """A control-plane target: `unix:/absolute/path` (a closed local cluster's socket) or HOST:PORT."""
    if is_unix_target(target):
        if not target[len(UNIX) :].startswith("/"):
            raise ConfigError(f"{name}: expected unix:/absolute/path or HOST:PORT, got {target!r}")
        return
    parse_address(name, target)


def closed_line(how: str, control: str) -> str:
    return (
        f"TF ports closed: the tasks run in their own {how}, where only they reach each other's "
        f"TensorFlow servers; control plane on {control}"
    )


def open_line() -> str:
    return (
        f"TF ports open on request ({ALLOW_FLAG}): every task's TensorFlow server listens on all "
        "interfaces without authentication while it trains"
    )


def refusal(reason: str) -> str:
    """The one-line refusal where a local cluster cannot be closed."""
    return (
        f"local cluster: no private network namespace can be made here ({reason}), so every task's TensorFlow "
        "server would listen on all interfaces without authentication and run any op sent to it; allow "
        "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 or user.max_user_namespaces) "
        f"or run as root, or pass {ALLOW_FLAG} to accept the open ports"
    )


def no_private_network_refusal() -> str:
    """The one-line refusal of `private_network = false` without `allow_open_ports`."""
    return (
        "cluster.private_network: false runs a local cluster's tasks on this machine's network, where every "
        "TensorFlow server listens on all interfaces without authentication; pass --allow-open-ports as well "
        "to accept the open ports, or leave it true"
    )


def rules_line(ports: list[int], peers: list[str], what: str, name: str) -> str:
    """`what`: "nftables table" or "iptables chain" (rulesets.TOOLS)."""
    return (
        f"TF ports {', '.join(map(str, sorted(set(ports))))} closed to all but the cluster's hosts "
        f"({', '.join(sorted(peers))}) by {what} {name}, removed when this run ends"
    )


def node_refusal(reason: str) -> str:
    return (
        f"cluster: this machine's TF ports cannot be closed to hosts outside the cluster ({reason}), and each "
        "TensorFlow server listens on all interfaces without authentication and runs any op sent to it; run "
        f"as root with nftables or iptables installed, or pass {ALLOW_FLAG} to accept the open ports (README: Security)"
    )


def unclosed_line(reason: str) -> str:
    return (
        f"TF ports open to the network ({reason}): each TensorFlow server listens on all interfaces without "
        "authentication; keep the cluster on a private network (README: Security)"
    )
