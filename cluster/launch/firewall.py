"""A node's TF ports closed to all but the cluster's own hosts, for exactly as long as its run lasts.

The rules (cluster/rulesets.py) are an nftables table, or where nft is missing an iptables chain (IPv4
and IPv6), of their own, `pstrain_<pid>`, owned by a guardian process (`python -m
cluster.launch.firewall guard TOOL PORTS PEERS`): it removes the rules of guardians that are gone (a
guardian killed with SIGKILL), adds its own, says their name, and deletes them once its stdin closes:
when the launcher or node closes it at the end of the run, or when the kernel closes it because the
launcher or node died, whatever killed it (SIGKILL included). A SIGTERM, SIGINT or SIGHUP to the
guardian itself, at any moment, also ends in the deletion; a guardian that hangs is killed by its
launcher (`end_guardian`), which deletes the rules itself.
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

from cluster import rulesets
from cluster.config import ClusterConfig, parse_address, task_addresses
from cluster.launch import lifeline

READY_TIMEOUT_S = 30.0
TOOL_COMMANDS = ("nft", "iptables", "ip6tables")


class Unclosable(Exception):
    """This node cannot make the rules; the message says why (one line)."""


def choose() -> tuple[str, str]:
    """(tool, "") that makes the rules on this machine, or ("", why none can): rulesets.choose."""
    return rulesets.choose(os.geteuid(), {command for command in TOOL_COMMANDS if shutil.which(command)})


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


def _run(argv: list[str], text: str | None = None) -> subprocess.CompletedProcess:
    """A rules command, with no stdin but `text`: it never holds the guardian's lifeline (its stdin)."""
    stdin = None if text is not None else subprocess.DEVNULL
    return subprocess.run(argv, input=text, stdin=stdin, capture_output=True, text=True, timeout=30)


def _first_error(done: subprocess.CompletedProcess, tool: str) -> str:
    return (done.stderr.strip().splitlines() or [f"{tool} failed"])[0]


class Nft:
    """nftables: one table `inet pstrain_<pid>`."""

    def names(self) -> list[str]:
        return rulesets.nft_names(_run(["nft", "list", "tables"]).stdout)

    def make(self, name: str, ports: list[int], peers: list[str]) -> str:
        done = _run(["nft", "-f", "-"], text=rulesets.nft_ruleset(name, ports, peers))
        return _first_error(done, "nft") if done.returncode else ""

    def delete(self, name: str) -> None:
        _run(["nft", "delete", "table", "inet", name])  # no error where it is gone already


class Iptables:
    """iptables and ip6tables: one chain `pstrain_<pid>` in each, jumped to from INPUT."""

    FAMILIES = {4: "iptables", 6: "ip6tables"}

    def names(self) -> list[str]:
        found = {n for command in self.FAMILIES.values() for n in rulesets.iptables_names(_run([command, "-w", "-S"]).stdout)}
        return sorted(found)

    def make(self, name: str, ports: list[int], peers: list[str]) -> str:
        for family, command in self.FAMILIES.items():
            done = _run([f"{command}-restore", "-w", "--noflush"], text=rulesets.iptables_restore(name, ports, peers, family))
            if done.returncode:
                return _first_error(done, f"{command}-restore")
        return ""

    def delete(self, name: str) -> None:
        for command in self.FAMILIES.values():
            removal = rulesets.iptables_removal(_run([command, "-w", "-S"]).stdout, name)
            if removal:
                _run([f"{command}-restore", "-w", "--noflush"], text=removal)


TOOLS = {rulesets.NFT: Nft, rulesets.IPTABLES: Iptables}


def guard(tool: str, ports: list[int], peers: list[str]) -> int:
    """The guardian (its own process): make the rules, wait for stdin to close or a stop signal,
    delete them. The stop signals are blocked from before the rules exist until they are deleted,
    and only waited for while nothing else runs, so no signal cuts the deletion out (a signal that
    arrives before the block ends the process by its default action, before anything is made)."""
    stops = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    rules_of, name = TOOLS[tool](), rulesets.name(os.getpid())
    try:
        for stale in rulesets.stale(rules_of.names(), psutil.pid_exists):
            rules_of.delete(stale)
        failed = rules_of.make(name, ports, peers)
        if failed:
            print(failed, file=sys.stderr, flush=True)
            return 1
        print(name, flush=True)
        _until_stdin_closes_or(stops)
        return 0
    finally:
        rules_of.delete(name)


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


def end_guardian(guardian: subprocess.Popen, tool: str, timeout_s: float = READY_TIMEOUT_S) -> str:
    """End a guardian started by `rules` and return the last line of its stderr. Closing its stdin
    makes it delete its rules and exit; one that has not within `timeout_s` is killed and its rules
    (made with `tool`) deleted from here. Never raises for a slow guardian; reaps it, closes its pipes."""
    try:
        if lifeline.cut(guardian, timeout_s):
            TOOLS[tool]().delete(rulesets.name(guardian.pid))
        lines = guardian.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""
    finally:
        guardian.stdout.close()
        guardian.stderr.close()


@contextlib.contextmanager
def rules(tool: str, ports: list[int], peers: list[str], timeout_s: float = READY_TIMEOUT_S) -> Iterator[str]:
    """The rules made with `tool` (rulesets.NFT or IPTABLES), for as long as the block runs (and no
    longer than this process lives); yields their name. Unclosable where the guardian could not make them."""
    ports_arg, peers_arg = ",".join(map(str, ports)), ",".join(peers)
    argv = [sys.executable, "-m", "cluster.launch.firewall", "guard", tool, ports_arg, peers_arg]
    guardian = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    ended = False
    try:
        ready, _, _ = select.select([guardian.stdout], [], [], timeout_s)
        table = guardian.stdout.readline().decode().strip() if ready else ""
        if rulesets.owner(table) is None:
            why, ended = end_guardian(guardian, tool, timeout_s), True
            raise Unclosable(why or f"no answer from {tool} in {timeout_s:g}s")
        yield table
    finally:
        if not ended:
            end_guardian(guardian, tool, timeout_s)


def main(args: list[str]) -> int:
    if len(args) == 4 and args[0] == "guard" and args[1] in TOOLS:
        ports = [int(p) for p in args[2].split(",") if p]
        return guard(args[1], ports, [p for p in args[3].split(",") if p])
    print(f"usage: python -m cluster.launch.firewall guard {'|'.join(TOOLS)} PORT,... PEER,...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
