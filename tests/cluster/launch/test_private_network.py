"""A real private network namespace (cluster/launch/netns.py): a server started in it listens on every
interface of the namespace, yet nothing outside reaches it; the process keeps its pid; a namespace that
cannot be made refuses a local launch in one line unless --allow-open-ports."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from cluster.config import ConfigError, resolve
from cluster.doctor.listeners import listeners
from cluster.launch.closing import closed
from cluster.launch.netns import PrivateNetwork, Unavailable
from tests.netns import netns_tier

ROOT = Path(__file__).resolve().parents[3]

pytestmark = netns_tier()  # "root" needs root; the same run makes the unprivileged kind too

SERVE = "import os,socket;s=socket.create_server(('0.0.0.0',0));print(os.getpid(),s.getsockname()[1],flush=True);input()"


@pytest.mark.parametrize("kind", ["user", "root"])
def test_a_server_inside_is_reached_from_inside_only_and_keeps_its_pid(kind):
    network = PrivateNetwork.make((kind,))
    try:
        argv = network.wrap([sys.executable, "-c", SERVE])
        server = subprocess.Popen(argv, pass_fds=network.fds, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            pid, port = map(int, server.stdout.readline().split())
            assert pid == server.pid, "exec'd in place: no wrapper process between the launcher and the task"
            assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            connect = f"import socket;socket.create_connection(('127.0.0.1',{port}),5);print('in')"
            inside = subprocess.run(
                network.wrap([sys.executable, "-c", connect]),
                pass_fds=network.fds,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert inside.stdout.strip() == "in", inside.stderr
            assert [(x.address, x.port, x.private) for x in listeners([pid])] == [("0.0.0.0", port, True)]
        finally:
            server.stdin.close()
            server.wait(timeout=30)
    finally:
        network.close()
    assert network.fds == ()


def test_a_task_that_cannot_enter_never_runs_outside():
    entered = subprocess.run(
        [sys.executable, "-m", "cluster.launch.netns", "enter", "-1", "987", "--", "echo", "ran"], capture_output=True, text=True
    )
    assert entered.returncode == 1 and "ran" not in entered.stdout
    assert entered.stderr.startswith("pstrain: cannot enter the run's private network namespace")
    assert entered.stderr.count("\n") == 1


def test_no_namespace_refuses_a_local_launch_unless_open_ports_are_allowed(tmp_path):
    cluster = resolve({}).cluster
    with pytest.raises(ConfigError, match="--allow-open-ports"), closed(cluster, None, tmp_path, [], kinds=()):
        pass
    allowed = resolve({}, {"allow_open_ports": True}).cluster
    with closed(allowed, None, tmp_path, [], kinds=()) as doors:
        assert doors.open and doors.network is None and doors.cluster == allowed and "open on request" in doors.line
    with closed(cluster, None, tmp_path, []) as doors:
        assert not doors.open and doors.cluster.control == f"unix:{tmp_path}/control.sock"
    assert not (tmp_path / "control.sock").exists()


UNPRIVILEGED = """\
import os, socket, subprocess, sys
from cluster.launch.netns import PrivateNetwork
network = PrivateNetwork.make(("user",))
serve = "import os,socket;s=socket.create_server(('0.0.0.0',0));print(os.getuid(),s.getsockname()[1],flush=True);input()"
server = subprocess.Popen(network.wrap([sys.executable, "-c", serve]), pass_fds=network.fds, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
uid, port = map(int, server.stdout.readline().split())
try:
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    outside = "connected"
except ConnectionRefusedError:
    outside = "refused"
server.stdin.close()
server.wait()
print(os.getuid(), uid, outside)
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="no system /usr/bin/python3 that nobody may run")
def test_an_unprivileged_user_makes_the_namespace_and_its_tasks_keep_their_uid(tmp_path):
    """As `nobody` (setpriv), with the package copied where nobody can read it: the kind a non-root
    launcher makes, for real without privilege."""
    switch = Path("/proc/sys/kernel/unprivileged_userns_clone")
    if switch.exists() and switch.read_text().strip() == "0":
        pytest.skip("this kernel refuses unprivileged user namespaces (kernel.unprivileged_userns_clone=0)")
    root = Path(tempfile.mkdtemp(prefix="pst-nobody-"))
    try:
        modules = ("__init__.py", "launch/__init__.py", "launch/netns.py", "launch/lifeline.py")  # what netns.py imports
        for name in (f"cluster/{m}" for m in modules):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, root / name)
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755)
        python = "/usr/bin/python3"  # one that `nobody` may run (the netns module needs the standard library only)
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", UNPRIVILEGED]
        env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
        done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(root)
    assert done.stdout.split() == ["65534", "65534", "refused"], done.stderr


def namespace_fds() -> list[str]:
    """The network namespaces this process holds by a descriptor (its own is not held that way)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [link for link in held if link.startswith("net:")]


def test_a_maker_that_fails_leaves_no_descriptor_and_no_process():
    before, fds = namespace_fds(), len(os.listdir("/proc/self/fd"))
    with pytest.raises(Unavailable, match="usage"):
        PrivateNetwork._make("bogus")  # the maker refuses (exit 2) instead of saying ready
    assert namespace_fds() == before and len(os.listdir("/proc/self/fd")) == fds
    assert psutil.Process().children() == []


def test_a_failure_after_the_namespace_is_made_releases_it(tmp_path, monkeypatch):
    """A run dir too long for a socket and no temporary folder to put one in: the launch fails after
    the namespace exists; its descriptors are closed all the same."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    long_run_dir = tmp_path / ("d" * 120)
    before = namespace_fds()
    with pytest.raises(FileNotFoundError), closed(resolve({}).cluster, None, long_run_dir, []):
        pass
    assert namespace_fds() == before
    assert psutil.Process().children() == []


def test_no_private_network_runs_on_the_hosts_network_only_with_open_ports_allowed(tmp_path):
    """`--no-private-network` (the benchmarks' A/B switch): no namespace is made, and without
    `--allow-open-ports` it is refused in one line."""
    before = namespace_fds()
    with (
        pytest.raises(ConfigError, match="--allow-open-ports"),
        closed(resolve({}, {"private_network": False}).cluster, None, tmp_path, []),
    ):
        pass
    opened = resolve({}, {"private_network": False, "allow_open_ports": True}).cluster
    with closed(opened, None, tmp_path, []) as doors:
        assert doors.open and doors.network is None and doors.cluster == opened and namespace_fds() == before
    assert psutil.Process().children() == []
