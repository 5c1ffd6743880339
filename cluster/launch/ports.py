"""Side effects on the network: picking free ports and checking fixed ones are free."""

from __future__ import annotations

import socket
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


def assign_ports(cluster: ClusterConfig, local: frozenset[str] = frozenset()) -> ClusterConfig:
    """Replace every port 0 with a free port; check that fixed ports of this machine's tasks are free.

    Tasks on other machines keep their ports; port 0 there is an error (we cannot pick for them).
    """
    used: set[int] = set()

    def resolve(name: str, address: str) -> str:
        host, port = parse_address(name, address)
        here = is_local_host(host, local)
        if port == 0:
            if not here:
                raise ConfigError(f"{name}: port 0 (pick a free port) works only on this machine; give {host} a port")
            port = free_port(host)
            while port in used:
                port = free_port(host)
        elif here:
            check_port_free(name, host, port)
        used.add(port)
        return format_address(host, port)

    return replace(
        cluster,
        chief=resolve("cluster.chief", cluster.chief),
        control=resolve("cluster.control", cluster.control),
        ps=tuple(resolve(f"cluster.ps[{i}]", a) for i, a in enumerate(cluster.ps)),
        workers=tuple(resolve(f"cluster.workers[{i}]", a) for i, a in enumerate(cluster.workers)),
    )
