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
from pathlib import Path

import pytest

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


def _tc(namespace: str, device: str, qdisc: list[str]) -> None:
    argv = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", *qdisc]
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


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


def netns_tier() -> list:
    """A module's `pytestmark` in the netns tier: the marker, and a skip that says why where this process
    cannot make network namespaces (CI fails on that skip for a proof test: tests/proof.py)."""
    why = can_create_namespaces()
    return [pytest.mark.netns, pytest.mark.skipif(bool(why), reason=f"cannot create network namespaces here: {why}")]


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


@contextlib.contextmanager
def lan(prefix: str, members: dict[str, list[str]], subnet: str, shaping: list[str] | None = None) -> Iterator[dict[str, Host]]:
    """One namespace per member, all on a bridge in a namespace of its own (nothing in the root
    namespace); each member's /etc/hosts (under `ip netns exec`) maps every member's names to its
    address `subnet`.<i+1>. `shaping`: a `tc qdisc add dev D root` tail (e.g. tbf's) put on both ends
    of every member's veth, so each member's link is shaped both ways (tests/benchmarks/links.py).
    Namespaces and their /etc/netns folders are removed afterwards."""
    suffix = f"{os.getpid() % 100000}"
    switch = f"{prefix}sw-{suffix}"
    hosts = {label: Host(f"{prefix}{label}-{suffix}", f"{subnet}.{i + 1}", "eth0") for i, label in enumerate(members)}
    table = "127.0.0.1 localhost\n::1 localhost ip6-localhost\n"
    table += "".join(f"{hosts[label].address} {' '.join(names)}\n" for label, names in members.items())
    created: list[str] = []
    folders: list[Path] = []
    try:
        _ip("netns", "add", switch)
        created.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(hosts.values()):
            folder = Path("/etc/netns") / host.namespace
            folder.mkdir(parents=True)
            folders.append(folder)
            (folder / "hosts").write_text(table)
            _ip("netns", "add", host.namespace)
            created.append(host.namespace)
            _ip("-n", switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", host.device, "netns", host.namespace)
            _ip("-n", switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", switch, "link", "set", f"p{i}", "up")
            host.run("ip", "addr", "add", f"{host.address}/24", "dev", host.device)
            host.run("ip", "link", "set", host.device, "up")
            host.run("ip", "link", "set", "lo", "up")
            if shaping:
                host.run("tc", "qdisc", "add", "dev", host.device, "root", *shaping)  # what the member sends
                _tc(switch, f"p{i}", shaping)  # what it receives
        yield hosts
    finally:
        for namespace in reversed(created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
