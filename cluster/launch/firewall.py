"""A node's TF ports closed to all but the cluster's own hosts, for exactly as long as its run lasts.

The rules (cluster/doors.py `nft_ruleset`) live in an nftables table of their own, `pstrain_<pid>`,
owned by a guardian process (`python -m cluster.launch.firewall guard PORTS PEERS`): it removes the
tables of guardians that are gone (a guardian killed with SIGKILL), adds its table, says "ready", and
deletes its table once its stdin closes: when the launcher or node closes it at the end of the run,
or when the kernel closes it because the launcher or node died, whatever killed it (SIGKILL included).
A SIGTERM, SIGINT or SIGHUP to the guardian itself, at any moment, also ends in the deletion; a
guardian that hangs is killed by its launcher (`end_guardian`), which deletes the table itself.
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
    """nft, with no stdin but `text`: it never holds the guardian's lifeline (its stdin)."""
    stdin = None if text is not None else subprocess.DEVNULL
    return subprocess.run(["nft", *args], input=text, stdin=stdin, capture_output=True, text=True, timeout=30)


def delete_table(table: str) -> None:
    """Delete `table` (no error where it is gone already)."""
    _nft("delete", "table", "inet", table)


def guard(ports: list[int], peers: list[str]) -> int:
    """The guardian (its own process): make the table, wait for stdin to close or a stop signal,
    delete the table. The stop signals are blocked from before the table exists until it is deleted,
    and only waited for while nothing else runs, so no signal cuts the deletion out (a signal that
    arrives before the block ends the process by its default action, before anything is made)."""
    stops = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    table = doors.table_name(os.getpid())
    try:
        for stale in doors.stale_tables(_nft("list", "tables").stdout, psutil.pid_exists):
            delete_table(stale)
        made = _nft("-f", "-", text=doors.nft_ruleset(table, ports, peers))
        if made.returncode != 0:
            print((made.stderr.strip().splitlines() or ["nft failed"])[0], file=sys.stderr, flush=True)
            return 1
        print(table, flush=True)
        _until_stdin_closes_or(stops)
        return 0
    finally:
        delete_table(table)


def _until_stdin_closes_or(stops: set[signal.Signals]) -> None:
    """Wait (the stop signals blocked on entry and on return) for stdin's end or one of `stops`."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in stops}  # the wakeup fd does the work
    signal.set_wakeup_fd(wake_w)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)  # a pending signal is handled here: wake_r is readable
        select.select([sys.stdin.fileno(), wake_r], [], [])
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        signal.set_wakeup_fd(-1)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(wake_r)
        os.close(wake_w)


def end_guardian(guardian: subprocess.Popen, timeout_s: float = READY_TIMEOUT_S) -> str:
    """End a guardian started by `rules` and return the last line of its stderr. Closing its stdin
    makes it delete its table and exit; one that has not within `timeout_s` is killed and its table
    deleted from here. Never raises for a slow guardian; reaps it and closes its pipes."""
    try:
        guardian.stdin.close()
        try:
            guardian.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            guardian.kill()
            guardian.wait()
            delete_table(doors.table_name(guardian.pid))
        lines = guardian.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""
    finally:
        guardian.stdout.close()
        guardian.stderr.close()


@contextlib.contextmanager
def rules(ports: list[int], peers: list[str], timeout_s: float = READY_TIMEOUT_S) -> Iterator[str]:
    """The rules, for as long as the block runs (and no longer than this process lives); yields the
    table's name. Unclosable where the guardian could not make them."""
    argv = [sys.executable, "-m", "cluster.launch.firewall", "guard", ",".join(map(str, ports)), ",".join(peers)]
    guardian = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    ended = False
    try:
        ready, _, _ = select.select([guardian.stdout], [], [], timeout_s)
        table = guardian.stdout.readline().decode().strip() if ready else ""
        if not table.startswith(doors.TABLE_PREFIX):
            why, ended = end_guardian(guardian, timeout_s), True
            raise Unclosable(why or f"no answer from nft in {timeout_s:g}s")
        yield table
    finally:
        if not ended:
            end_guardian(guardian, timeout_s)


def main(args: list[str]) -> int:
    if len(args) == 3 and args[0] == "guard":
        ports = [int(p) for p in args[1].split(",") if p]
        return guard(ports, [p for p in args[2].split(",") if p])
    print("usage: python -m cluster.launch.firewall guard PORT,... PEER,...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
