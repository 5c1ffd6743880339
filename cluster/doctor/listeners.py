"""Where a run's doors are: the listening TCP sockets of its processes, from /proc (Linux).

Each process's table is read in its own network namespace (/proc/PID/net/tcp and tcp6) and matched to
the socket inodes the process holds (/proc/PID/fd), so a task in a private namespace (cluster/doors.py)
is seen there, where psutil's host-wide view does not see it at all.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str  # as bound: "0.0.0.0" and "::" are every interface of the namespace
    port: int
    private: bool  # in a network namespace other than this process's own (the run's private one)

    @property
    def reach(self) -> str:
        """Who can connect to it. Pure."""
        if self.private:
            return "the run's own tasks only (private network namespace)"
        if self.address.startswith("127.") or self.address in ("::1", "::ffff:127.0.0.1"):
            return "this machine only (loopback)"
        return "any host that reaches this machine"


def _address(hex_address: str) -> tuple[str, int]:
    """'0100007F:1F90' -> ('127.0.0.1', 8080); IPv6 as four little-endian 32-bit words. Pure."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i : i + 4])[0]) for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(port, 16)


def parse_table(text: str) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of the LISTEN rows of a /proc/net/tcp or tcp6 table. Pure."""
    rows = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[3] == LISTEN:
            rows[int(fields[9])] = _address(fields[1])
    return rows


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listeners(pids: list[int]) -> list[Listener]:
    """Every listening TCP socket of `pids` (those gone or unreadable are skipped), by pid and port."""
    here = os.readlink("/proc/self/ns/net")
    found = []
    for pid in pids:
        try:
            private = os.readlink(f"/proc/{pid}/ns/net") != here
            table = {}
            for name in ("tcp", "tcp6"):
                table.update(parse_table(Path(f"/proc/{pid}/net/{name}").read_text()))
            inodes = _socket_inodes(pid)
        except OSError:
            continue
        found += [Listener(pid, *table[inode], private) for inode in inodes if inode in table]
    return sorted(found, key=lambda x: (x.pid, x.port))
