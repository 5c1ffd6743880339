"""A private network namespace for a local cluster's tasks: their TensorFlow servers (which bind
0.0.0.0 without authentication) exist only inside it, on its own loopback.

One piece per process:
- `python -m cluster.launch.netns make KIND` (the maker): a fresh process, single-threaded as
  unshare(2) of a user namespace requires (the launcher runs gRPC threads), moves into a new network
  namespace, brings its loopback up, prints "ready" and waits for its stdin to close. KIND "user": inside
  a new user namespace that maps the caller's uid and gid to themselves (no privilege needed where the
  kernel allows unprivileged user namespaces; the tasks keep their ids); KIND "root": a plain one (root).
- `PrivateNetwork` (the launcher): holds the namespace by descriptors of the maker's /proc/PID/ns files,
  then lets the maker exit. The kernel frees the namespace with its last holder (the launcher or a task),
  so no exit path (crash, SIGKILL) leaves anything behind.
- `python -m cluster.launch.netns enter USER_FD NET_FD -- ARGV` (every task's first image): joins the
  namespace through the descriptors passed to it, then execs ARGV, so the task keeps this pid: a stop
  or kill by pid reaches the task itself and no wrapper process stays. It never runs ARGV outside.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import socket
import struct
import subprocess
import sys
from pathlib import Path

from cluster.launch import lifeline

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
IFREQ = "16sh22x"  # struct ifreq: the name, then ifr_flags in a 24-byte union
KINDS = ("user", "root")
MAKE_TIMEOUT_S = 30.0


class Unavailable(Exception):
    """No namespace of any kind could be made here; the message says why (one line)."""


def kinds_to_try(euid: int) -> tuple[str, ...]:
    """Root makes a plain network namespace (its tasks keep root's access to files); anyone else an
    unprivileged user + network namespace. Root falls back to the latter where its own is refused (a
    container without CAP_SYS_ADMIN). Pure."""
    return ("root", "user") if euid == 0 else ("user",)


def describe(kind: str) -> str:
    return "unprivileged user + network namespace" if kind == "user" else "network namespace (made as root)"


def _syscall(name: str, *args: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")


def loopback_up() -> None:
    """`ip link set lo up`, by ioctl (no iproute2 needed): a new namespace's loopback starts down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(IFREQ, fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))


def make(kind: str) -> None:
    """The maker's work (in its own, single-threaded process): move into the new namespace(s)."""
    uid, gid = os.geteuid(), os.getegid()
    if kind == "user":
        _syscall("unshare", CLONE_NEWUSER | CLONE_NEWNET)
        Path("/proc/self/setgroups").write_text("deny")  # required before an unprivileged gid_map
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    else:
        _syscall("unshare", CLONE_NEWNET)
    loopback_up()


def enter(user_fd: int, net_fd: int, argv: list[str]) -> None:
    """Join the namespace (user first: it grants the right to join its network namespace), then exec."""
    if user_fd >= 0:
        _syscall("setns", user_fd, CLONE_NEWUSER)
        os.close(user_fd)
    _syscall("setns", net_fd, CLONE_NEWNET)
    os.close(net_fd)
    os.execvp(argv[0], argv)


def end_maker(maker: subprocess.Popen, timeout_s: float = MAKE_TIMEOUT_S) -> None:
    """Close the maker's stdin (on every path: it is its lifeline and our descriptor), reap it (killed
    where it has not exited within `timeout_s`: the namespace is held by descriptors, not by it) and
    close its pipes. Never raises for a slow maker."""
    try:
        lifeline.cut(maker, timeout_s)
    finally:
        maker.stdout.close()
        maker.stderr.close()


class PrivateNetwork:
    """A network namespace held open by the launcher; `wrap` + `fds` start a process inside it."""

    def __init__(self, kind: str, user_fd: int, net_fd: int):
        self.kind, self.user_fd, self.net_fd = kind, user_fd, net_fd

    @classmethod
    def make(cls, kinds: tuple[str, ...]) -> PrivateNetwork:
        """The first kind of `kinds` this machine allows; Unavailable (saying why each failed) if none."""
        reasons = []
        for kind in kinds:
            try:
                return cls._make(kind)
            except Unavailable as e:
                reasons.append(f"{describe(kind)}: {e}")
        raise Unavailable("; ".join(reasons))

    @classmethod
    def _make(cls, kind: str, timeout_s: float = MAKE_TIMEOUT_S) -> PrivateNetwork:
        argv = [sys.executable, "-m", "cluster.launch.netns", "make", kind]
        # A session of its own: a Ctrl-C meant for the launcher's stop trap does not kill the maker.
        # Its stdin is its lifeline (a pipe from here, never the launcher's own stdin): it exits at its end.
        maker = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        held: list[int] = []
        try:
            ready, _, _ = select.select([maker.stdout], [], [], timeout_s)
            line = maker.stdout.readline().decode().strip() if ready else ""
            if line != "ready":
                maker.kill()
                why = maker.communicate(timeout=timeout_s)[1].decode().strip().splitlines()
                raise Unavailable(why[-1] if why else f"no answer in {timeout_s:g}s")
            if kind == "user":
                held.append(os.open(f"/proc/{maker.pid}/ns/user", os.O_RDONLY))
            held.append(os.open(f"/proc/{maker.pid}/ns/net", os.O_RDONLY))
            network = cls(kind, held[0] if kind == "user" else -1, held[-1])
            held = []  # the network owns them now
            return network
        finally:
            for fd in held:  # opened, then a failure: not leaked
                os.close(fd)
            end_maker(maker, timeout_s)

    @property
    def fds(self) -> tuple[int, ...]:
        """The descriptors a process started with `wrap` must inherit (subprocess's pass_fds)."""
        return tuple(fd for fd in (self.user_fd, self.net_fd) if fd >= 0)

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv`, run inside the namespace under the same pid."""
        return [sys.executable, "-m", "cluster.launch.netns", "enter", str(self.user_fd), str(self.net_fd), "--", *argv]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.user_fd = self.net_fd = -1


def main(args: list[str]) -> int:
    if args[:1] == ["make"] and len(args) == 2 and args[1] in KINDS:
        try:
            make(args[1])
        except OSError as e:
            print(e.strerror or e, file=sys.stderr, flush=True)  # the launcher's reason, one line
            return 1
        print("ready", flush=True)
        sys.stdin.buffer.read()  # until the launcher holds the namespace (or is gone)
        return 0
    if args[:1] == ["enter"] and len(args) > 4 and args[3] == "--":
        try:
            enter(int(args[1]), int(args[2]), args[4:])
        except OSError as e:  # the task never runs outside the namespace
            print(f"pstrain: cannot enter the run's private network namespace: {e.strerror or e}", file=sys.stderr, flush=True)
            return 1
    print("usage: python -m cluster.launch.netns make user|root | enter USER_FD NET_FD -- ARGV", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
