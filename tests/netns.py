"""Two test hosts on one machine: network namespaces joined by a veth pair, removed afterwards.

The addresses exist only inside the namespaces this module creates; nothing is routed elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.251.{}.{}"


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    device: str

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def run(self, *argv: str) -> None:
        subprocess.run(self.command(list(argv)), check=True, capture_output=True, timeout=30)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def can_create_namespaces() -> str:
    """'' when this process can make namespaces, else why not."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"pst-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"ip netns add failed: {getattr(e, 'stderr', e)}"
    _ip("netns", "del", probe)
    return ""


@contextlib.contextmanager
def two_hosts(tag: int = 0) -> Iterator[tuple[Host, Host]]:
    """Namespaces A and B with addresses 10.251.<tag>.1 and .2 on a veth pair."""
    suffix = f"{os.getpid() % 100000}"
    a = Host(f"pst-a-{suffix}", SUBNET.format(tag, 1), f"pva{suffix}")
    b = Host(f"pst-b-{suffix}", SUBNET.format(tag, 2), f"pvb{suffix}")
    created: list[str] = []
    try:
        for host in (a, b):
            _ip("netns", "add", host.namespace)
            created.append(host.namespace)
        _ip("link", "add", a.device, "type", "veth", "peer", "name", b.device)
        for host in (a, b):
            _ip("link", "set", host.device, "netns", host.namespace)
            host.run("ip", "addr", "add", f"{host.address}/24", "dev", host.device)
            host.run("ip", "link", "set", host.device, "up")
            host.run("ip", "link", "set", "lo", "up")
        yield a, b
    finally:
        for namespace in created:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def set_link(host: Host, up: bool) -> None:
    host.run("ip", "link", "set", host.device, "up" if up else "down")
