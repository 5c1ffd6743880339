"""tests/conftest.py's `_free_port` in a network namespace of its own whose ephemeral range is 2 ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.netns import can_create_namespaces

pytestmark = pytest.mark.netns

WHY_NOT = can_create_namespaces()
ASK_THREE = """
import json
from tests.conftest import _free_port
ports = [_free_port(), _free_port()]
try:
    ports.append(_free_port())
except OSError:
    ports.append(None)
print(json.dumps(ports))
"""


@pytest.mark.skipif(bool(WHY_NOT), reason=f"cannot create network namespaces here: {WHY_NOT}")
def test_free_port_never_hands_out_a_port_twice():
    """With ports 40000-40001 only, two calls get both and a third has none left (the kernel alone
    would give the same free port again)."""
    namespace = f"pst-ports-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True, timeout=30)
    inside = ["ip", "netns", "exec", namespace]
    try:
        subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True, capture_output=True, timeout=30)
        range_2 = "net.ipv4.ip_local_port_range=40000 40001"
        subprocess.run([*inside, "sysctl", "-qw", range_2], check=True, capture_output=True, timeout=30)
        result = subprocess.run([*inside, sys.executable, "-c", ASK_THREE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr
    first, second, third = json.loads(result.stdout)
    assert {first, second} == {40000, 40001} and third is None, result.stdout
