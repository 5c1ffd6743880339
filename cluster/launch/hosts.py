"""This machine's own addresses and names, to tell which configured tasks run here."""

from __future__ import annotations

import socket

import psutil


def local_addresses() -> frozenset[str]:
    names = {socket.gethostname(), socket.getfqdn(), "localhost"}
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                names.add(a.address.split("%")[0])
    return frozenset(names)
