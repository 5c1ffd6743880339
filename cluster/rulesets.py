"""A node's rules that close its TF ports to all but the cluster's hosts, as text for the tool that
makes them (nftables, else iptables), and which tool a machine can use. Pure.

One set of rules per run on a node, named `pstrain_<guardian pid>`: an nftables table `inet
pstrain_<pid>`, or an iptables chain `pstrain_<pid>` (IPv4 and IPv6 alike) jumped to from INPUT for
the TF ports. The name says whose they are, so a later guardian removes those whose guardian is gone.
"""

from __future__ import annotations

from collections.abc import Callable

PREFIX = "pstrain_"
NFT, IPTABLES = "nft", "iptables"
TOOLS = {NFT: "nftables table", IPTABLES: "iptables chain"}
MULTIPORT_MAX = 15  # ports one iptables `-m multiport --dports` takes


def choose(euid: int, installed: set[str]) -> tuple[str, str]:
    """(tool, "") for the tool that makes the rules here, nftables first; ("", why not) where none can:
    not root, or neither `nft` nor both `iptables` and `ip6tables` (IPv6 must be closed too) installed."""
    if euid != 0:
        return "", "not root"
    if NFT in installed:
        return NFT, ""
    if {IPTABLES, "ip6tables"} <= installed:
        return IPTABLES, ""
    if IPTABLES in installed:
        return "", "iptables is installed without ip6tables, which IPv6 needs, and nft (nftables) is not"
    return "", "neither nft (nftables) nor iptables is installed"


def name(pid: int) -> str:
    return f"{PREFIX}{pid}"


def owner(rules: str) -> int | None:
    """The guardian pid a `pstrain_<pid>` name carries; None for any other name."""
    tail = rules[len(PREFIX) :]
    return int(tail) if rules.startswith(PREFIX) and tail.isdigit() else None


def _split(peers: list[str]) -> tuple[list[str], list[str]]:
    return sorted(p for p in peers if ":" not in p), sorted(p for p in peers if ":" in p)


def nft_ruleset(table: str, ports: list[int], peers: list[str]) -> str:
    """An nftables table admitting `ports` (this node's TF servers) from `peers` (the cluster's hosts'
    addresses) and loopback only; everyone else gets a TCP reset. Other traffic is left alone."""
    v4, v6 = _split(peers)
    dports = "{ " + ", ".join(str(p) for p in sorted(set(ports))) + " }"
    lines = [f"table inet {table} {{", "  chain doors {", "    type filter hook input priority filter - 10; policy accept;"]
    lines.append('    iif "lo" accept')
    if v4:
        lines.append(f"    tcp dport {dports} ip saddr {{ {', '.join(v4)} }} accept")
    if v6:
        lines.append(f"    tcp dport {dports} ip6 saddr {{ {', '.join(v6)} }} accept")
    lines += [f"    tcp dport {dports} reject with tcp reset", "  }", "}"]
    return "\n".join(lines) + "\n"


def nft_names(listing: str) -> list[str]:
    """The pstrain tables of `nft list tables` output."""
    found = [line.split()[-1] for line in listing.splitlines() if line.startswith("table inet ")]
    return [table for table in found if owner(table) is not None]


def iptables_restore(chain: str, ports: list[int], peers: list[str], family: int) -> str:
    """`iptables-restore --noflush` input (`ip6tables-restore` for `family` 6): a chain admitting
    `peers` of that family and loopback, resetting every other TCP connection, jumped to from the top
    of INPUT for `ports` only. One batch: made whole or not at all."""
    v4, v6 = _split(peers)
    ordered = sorted(set(ports))
    lines = ["*filter", f":{chain} - [0:0]"]
    for i in range(0, len(ordered), MULTIPORT_MAX):
        dports = ",".join(str(p) for p in ordered[i : i + MULTIPORT_MAX])
        lines.append(f"-I INPUT 1 -p tcp -m multiport --dports {dports} -j {chain}")
    lines.append(f"-A {chain} -i lo -j ACCEPT")
    lines += [f"-A {chain} -s {peer} -j ACCEPT" for peer in (v4 if family == 4 else v6)]
    lines += [f"-A {chain} -p tcp -j REJECT --reject-with tcp-reset", "COMMIT"]
    return "\n".join(lines) + "\n"


def iptables_names(listing: str) -> list[str]:
    """The pstrain chains of `iptables -S` output."""
    found = [line.split()[1] for line in listing.splitlines() if line.startswith("-N ") and len(line.split()) == 2]
    return [chain for chain in found if owner(chain) is not None]


def iptables_removal(listing: str, chain: str) -> str:
    """`iptables-restore --noflush` input that removes `chain` and INPUT's jumps to it, from `iptables -S`
    output; "" where there is nothing of it."""
    jumps = [line for line in listing.splitlines() if line.startswith("-A INPUT ") and line.split()[-2:] == ["-j", chain]]
    if not jumps and chain not in iptables_names(listing):
        return ""
    lines = ["*filter", *("-D" + jump[2:] for jump in jumps)]
    if chain in iptables_names(listing):
        lines += [f"-F {chain}", f"-X {chain}"]
    return "\n".join([*lines, "COMMIT"]) + "\n"


def stale(names: list[str], alive: Callable[[int], bool]) -> list[str]:
    """The pstrain rules among `names` whose guardian (`alive(pid)` False) is gone: a run whose
    guardian was itself killed. Pure but for `alive`."""
    return [rules for rules in names if not alive(owner(rules))]
