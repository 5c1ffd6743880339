"""Side effects on the network: picking free ports, waiting for servers to listen."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import replace

from cluster.config import (
    ClusterConfig,
    ConfigError,
    format_address,
    is_local_host,
    parse_address,
)


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(name: str, host: str, port: int) -> None:
    """A fixed port on this machine must be free before we start a server on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(
                f"{name}: cannot listen on {format_address(host, port)} ({e.strerror}); pick another port, or 0 for a free one"
            ) from None


def assign_ports(cluster: ClusterConfig, only_local: bool = True) -> ClusterConfig:
    """Replace every port 0 with a free port; check that fixed local ports are free."""
    used: set[int] = set()

    def resolve(name: str, address: str, check: bool) -> str:
        host, port = parse_address(name, address)
        if port == 0:
            if not is_local_host(host):
                raise ConfigError(f"{name}: port 0 (pick a free port) works only on this machine; give {host} a port")
            port = free_port(host)
            while port in used:
                port = free_port(host)
        elif check and is_local_host(host):
            check_port_free(name, host, port)
        used.add(port)
        return format_address(host, port)

    return replace(
        cluster,
        chief=resolve("cluster.chief", cluster.chief, only_local),
        ps=tuple(resolve(f"cluster.ps[{i}]", a, only_local) for i, a in enumerate(cluster.ps)),
        workers=tuple(resolve(f"cluster.workers[{i}]", a, only_local) for i, a in enumerate(cluster.workers)),
    )


def accepts_connections(address: str, timeout: float = 0.5) -> bool:
    host, port = parse_address("address", address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_listening(addresses: dict[str, str], deadline_s: float, still_alive: Callable[[], str | None]) -> list[str]:
    """Poll until every address accepts TCP connections or the deadline passes.

    `still_alive` returns the name of a task that died, if any, so a crashed server fails fast.
    Returns the names of the tasks still not listening (empty on success).
    """
    pending = dict(addresses)
    end = time.monotonic() + deadline_s
    while pending and time.monotonic() < end:
        dead = still_alive()
        if dead:
            return [dead]
        for name, address in list(pending.items()):
            if accepts_connections(address):
                del pending[name]
        if pending:
            time.sleep(0.2)
    return sorted(pending)
