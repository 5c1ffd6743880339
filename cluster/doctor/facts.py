"""Thin gatherers for the doctor: nvidia-smi, installed packages, probes, sockets, disk, the chief."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from cluster.doctor.checks import Gpu, GpuProcess, Probe, Smi
from cluster.taskenv import CUDA_ENV

SMI_TIMEOUT_S = 20
PROBE_TIMEOUT_S = 180


def nvidia_smi() -> Smi:
    if not shutil.which("nvidia-smi"):
        return Smi(found=False)
    gpus, error = _smi_csv("--query-gpu=index,uuid,name,driver_version,memory.total,memory.used")
    if "No devices were found" in error:
        return Smi(found=True)
    if error:
        return Smi(found=True, error=error)
    procs, error = _smi_csv("--query-compute-apps=gpu_uuid,pid,process_name,used_memory")
    return Smi(
        found=True,
        error=error,
        gpus=tuple(Gpu(int(r[0]), r[1], r[2], r[3], _int(r[4]), _int(r[5])) for r in gpus if len(r) >= 6),
        processes=tuple(GpuProcess(r[0], _int(r[1]), r[2], _int(r[3])) for r in procs if len(r) >= 4),
    )


def _smi_csv(query: str) -> tuple[list[list[str]], str]:
    try:
        result = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=SMI_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError) as e:
        return [], str(e)
    if result.returncode != 0:
        lines = (result.stdout + result.stderr).strip().splitlines()
        return [], lines[0] if lines else f"exit code {result.returncode}"
    return [[c.strip() for c in line.split(",")] for line in result.stdout.splitlines() if line.strip()], ""


def _int(text: str) -> int:
    try:
        return int(float(text))
    except ValueError:
        return 0


def distributions() -> dict[str, str]:
    """Installed distributions, by normalized name."""
    return {d.metadata["Name"].lower().replace("_", "-"): d.version for d in metadata.distributions() if d.metadata["Name"]}


def tf_requirements(dists: dict[str, str]) -> list[str]:
    for name in ("tensorflow", "tensorflow-cpu"):
        if name in dists:
            return metadata.requires(name) or []
    return []


def probe(cuda_visible_devices: str | None, matmul: bool) -> Probe:
    """Run cluster/doctor/probe.py in a process of its own with that CUDA_VISIBLE_DEVICES."""
    env = {k: v for k, v in os.environ.items() if k != CUDA_ENV} | {"TF_USE_LEGACY_KERAS": "1"}
    if cuda_visible_devices is not None:
        env[CUDA_ENV] = cuda_visible_devices
    argv = [sys.executable, "-m", "cluster.doctor.probe"] + (["--matmul"] if matmul else [])
    try:
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        data = json.loads(result.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return Probe(cuda_visible_devices, error=f"the probe process failed ({type(e).__name__})")
    return Probe(
        data.get("cuda_visible_devices"),
        tuple(data.get("gpus", [])),
        data.get("build", {}),
        data.get("matmul_device", ""),
        data.get("error", ""),
    )


def port_state(host: str, port: int) -> str:
    """ "" when `port` can be bound on `host` (free), "auto" for 0, else why not."""
    if port == 0:
        return "auto"
    from cluster.errors import ConfigError
    from cluster.launch.ports import check_port_free

    try:
        check_port_free(f"{host}:{port}", host, port)
    except ConfigError as e:
        return str(e).split(";")[0]
    return ""


def host_state(host: str, port: int, local: frozenset[str], timeout_s: float = 2.0) -> str:
    """ "local", "reachable" (a TCP connect was answered, even refused), or why not."""
    from cluster.config import is_local_host

    if is_local_host(host, local):
        return "local"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve {host} ({e.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.settimeout(timeout_s)
        code = s.connect_ex(address)
    if code in (0, errno.ECONNREFUSED):
        return "reachable"
    if code in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINPROGRESS):
        return f"{host}:{port} did not answer within {timeout_s:g}s (down, or a firewall drops the packets)"
    return f"{host}:{port} unreachable ({os.strerror(code)})"


def resolve_ip(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None)[0][4][0]
    except socket.gaierror:
        return ""


def writable(path: Path) -> tuple[str, int]:
    """(why not writable or "", free bytes) for `path` or its nearest existing parent."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".pstrain-doctor-"):
            pass
    except OSError as e:
        return e.strerror or str(e), 0
    return "", shutil.disk_usage(existing).free


def chief_status(address: str, creds, tries: int = 3) -> tuple[dict, list[float], float | None]:
    """(status, round-trip seconds, this clock minus the chief's) from the Status RPC."""
    from cluster.control.proto import control_pb2 as pb
    from cluster.control.service import RPC_TIMEOUT_S, status_dict, stub

    control = stub(address, creds)
    trips, skews, reply = [], [], None
    for _ in range(tries):
        t0, wall0 = time.monotonic(), time.time()
        reply = control.Status(pb.StatusRequest(), timeout=RPC_TIMEOUT_S)
        trip = time.monotonic() - t0
        trips.append(trip)
        if reply.time:
            skews.append(wall0 + trip / 2 - reply.time)
    skew = sorted(skews)[len(skews) // 2] if skews else None
    return status_dict(reply), trips, skew


def connect_time(address: str, tries: int = 3, timeout_s: float = 2.0) -> float | str:
    """Median seconds of a TCP connect to `address` (a task's TF server: one round trip), or why not."""
    from cluster.config import parse_address

    host, port = parse_address("task", address)
    times = []
    for _ in range(tries):
        t0 = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                times.append(time.monotonic() - t0)
        except OSError as e:
            return f"cannot connect to {address} ({e.strerror or type(e).__name__})"
    return sorted(times)[len(times) // 2]
