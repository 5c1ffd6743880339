"""A node's TF ports closed to all but the cluster's own hosts, for exactly as long as its run lasts.

The rules (cluster/doors.py `nft_ruleset`) live in an nftables table of their own, `pstrain_<pid>`,
owned by a guardian process (`python -m cluster.launch.firewall guard PORTS PEERS`): it removes the
tables of guardians that are gone (a guardian killed with SIGKILL), adds its table, says "ready", and
deletes its table once its stdin closes: when the launcher or node closes it at the end of the run,
or when the kernel closes it because the launcher or node died, whatever killed it (SIGKILL included).
A SIGTERM, SIGINT or SIGHUP to the guardian itself also ends in the deletion.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import psutil

from cluster import doors
from cluster.config import ClusterConfig, parse_address, task_addresses

READY_TIMEOUT_S = 30.0


class Unclosable(Exception):
    """This node cannot make the rules; the message says why (one line)."""


def why_not() -> str:
    """ "" where this process can make the rules, else why not."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("nft") is None:
        return "nft (nftables) is not installed"
    return ""


def peer_addresses(cluster: ClusterConfig) -> list[str]:
    """Every address the cluster's hosts (tasks and control plane) resolve to: who may connect."""
    hosts = {parse_address(name, address)[0] for name, address in task_addresses(cluster)}
    found: set[str] = set()
    for host in hosts:
        try:
            found |= {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
        except socket.gaierror as e:
            raise Unclosable(f"cannot resolve the cluster's host {host} ({e.strerror})") from None
    return sorted(a.split("%")[0] for a in found)


def _nft(*args: str, text: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["nft", *args], input=text, capture_output=True, text=True, timeout=30)


def guard(ports: list[int], peers: list[str]) -> int:
    """The guardian (its own process): make the table, wait for stdin to close, delete the table."""
    table = doors.table_name(os.getpid())
    for stale in doors.stale_tables(_nft("list", "tables").stdout, psutil.pid_exists):
        _nft("delete", "table", "inet", stale)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(0))
    made = _nft("-f", "-", text=doors.nft_ruleset(table, ports, peers))
    if made.returncode != 0:
        print((made.stderr.strip().splitlines() or ["nft failed"])[0], file=sys.stderr, flush=True)
        return 1
    try:
        print(table, flush=True)
        sys.stdin.buffer.read()
    finally:
        _nft("delete", "table", "inet", table)
    return 0


@contextlib.contextmanager
def rules(ports: list[int], peers: list[str]) -> Iterator[str]:
    """The rules, for as long as the block runs (and no longer than this process lives); yields the
    table's name. Unclosable where the guardian could not make them."""
    argv = [sys.executable, "-m", "cluster.launch.firewall", "guard", ",".join(map(str, ports)), ",".join(peers)]
    guardian = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        ready, _, _ = select.select([guardian.stdout], [], [], READY_TIMEOUT_S)
        table = guardian.stdout.readline().decode().strip() if ready else ""
        if not table.startswith(doors.TABLE_PREFIX):
            guardian.kill()
            why = guardian.communicate(timeout=READY_TIMEOUT_S)[1].decode().strip().splitlines()
            raise Unclosable(why[-1] if why else f"no answer from nft in {READY_TIMEOUT_S:g}s")
        yield table
    finally:
        guardian.stdin.close()  # the guardian deletes the table and exits
        guardian.wait(timeout=READY_TIMEOUT_S)
        guardian.stdout.close()
        guardian.stderr.close()


def main(args: list[str]) -> int:
    if len(args) == 3 and args[0] == "guard":
        ports = [int(p) for p in args[1].split(",") if p]
        return guard(ports, [p for p in args[2].split(",") if p])
    print("usage: python -m cluster.launch.firewall guard PORT,... PEER,...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
