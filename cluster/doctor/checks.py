"""The doctor's checks: pure functions from gathered facts (cluster/doctor/facts.py) to results.

Each check returns `Check`s: OK, INFO, WARN or FAIL, a one-line finding, and for WARN/FAIL the fix.
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, field
from typing import Any

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

TF_VERSION = "2.21.0"
# The oldest Linux driver each CUDA major version runs on (CUDA minor-version compatibility, from
# NVIDIA's CUDA Toolkit release notes, table 3).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
REINSTALL = "rm -rf .venv && deploy/bootstrap.sh (picks tensorflow[and-cuda] where nvidia-smi lists a GPU)"


@dataclass(frozen=True)
class Check:
    level: str  # "OK", "INFO", "WARN", "FAIL"
    name: str
    message: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.level:<4}  {self.name}: {self.message}" + (f"  -> fix: {self.fix}" if self.fix else "")

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    driver: str
    memory_total_mib: int
    memory_used_mib: int


@dataclass(frozen=True)
class GpuProcess:
    gpu_uuid: str
    pid: int
    name: str
    used_mib: int


@dataclass(frozen=True)
class Smi:
    """What nvidia-smi said: `found` False when it is not installed; `error` when it failed."""

    found: bool
    error: str = ""
    gpus: tuple[Gpu, ...] = ()
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class Probe:
    """What TensorFlow saw in a process of its own (cluster/doctor/probe.py)."""

    cuda_visible_devices: str | None
    gpus: tuple[str, ...] = ()
    build: dict[str, Any] = field(default_factory=dict)
    matmul_device: str = ""
    error: str = ""


def tensorflow_wheel(dists: dict[str, str], build: dict[str, Any], smi: Smi) -> list[Check]:
    """The installed TensorFlow distribution fits the machine: the CPU wheel on a GPU box is a FAIL."""
    name = "tensorflow.wheel"
    present = {d: v for d, v in dists.items() if d in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly")}
    if not present:
        return [Check("FAIL", name, "TensorFlow is not installed", "deploy/bootstrap.sh")]
    out = []
    if len(present) > 1:
        out.append(several_distributions(present, smi))
    dist, version = sorted(present.items())[-1] if "tensorflow" not in present else ("tensorflow", present["tensorflow"])
    if version != TF_VERSION:
        out.append(Check("FAIL", name, f"{dist} {version} installed; pstrain needs {TF_VERSION}", REINSTALL))
    cuda_build = str(build.get("is_cuda_build", "False")) == "True"
    gpus = len(smi.gpus)
    if gpus and not cuda_build:
        out.append(
            Check(
                "FAIL",
                name,
                f"{dist} {version} is a CPU-only build but this machine has {gpus} GPU(s): workers would not use them",
                REINSTALL,
            )
        )
    elif gpus:
        cuda = build.get("cuda_version", "?")
        out.append(Check("OK", name, f"{dist} {version}, built with CUDA {cuda} and cuDNN {build.get('cudnn_version', '?')}"))
    elif cuda_build:
        out.append(Check("INFO", name, f"{dist} {version} is a CUDA build; no GPU here, so it runs on the CPU"))
    else:
        out.append(Check("OK", name, f"{dist} {version} (CPU build) on a machine without an NVIDIA GPU"))
    return out


def several_distributions(present: dict[str, str], smi: Smi) -> Check:
    """Two TensorFlow distributions write the same `tensorflow/` package: the last one installed wins,
    and the doctor's other findings then describe it. The fix keeps the one this machine wants."""
    listed = ", ".join(f"{d} {v}" for d, v in sorted(present.items()))
    keep = "tensorflow" if smi.gpus else "tensorflow-cpu"
    drop = " ".join(d for d in sorted(present) if d != keep)
    fix = (
        f"pip uninstall -y {drop} && pip install --force-reinstall --no-deps '{keep}=={TF_VERSION}' "
        "(they share one package directory; or rm -rf .venv && deploy/bootstrap.sh); add Ray with deploy/install_ray.sh"
    )
    cause = "tf_keras or an extra (pip install .[ray]) pulled in `tensorflow`" if "tensorflow" in present else "two installs"
    return Check(
        "FAIL", "tensorflow.wheel", f"several TensorFlow distributions installed ({listed}), one over the other ({cause})", fix
    )


def cuda_libraries(requirements: list[str], installed: dict[str, str], build: dict[str, Any], smi: Smi) -> list[Check]:
    """The pip nvidia-* libraries (CUDA runtime, cuDNN, NCCL, ...) within TensorFlow's own pins.

    `requirements`: the TF distribution's Requires-Dist lines (its `and-cuda` extra holds the pins).
    """
    name = "cuda.libraries"
    cuda_build = str(build.get("is_cuda_build", "False")) == "True"
    if not smi.gpus:  # no GPU: TensorFlow runs on the CPU whatever its build, without the CUDA libraries
        return [Check("OK", name, "not needed (no GPU)" + (" though TensorFlow is a CUDA build" if cuda_build else ""))]
    pins = [Requirement(r) for r in requirements]
    pins = [r for r in pins if r.name.startswith("nvidia-") and r.marker and r.marker.evaluate({"extra": "and-cuda"})]
    if not pins:
        return [Check("WARN", name, "TensorFlow's metadata lists no and-cuda pins; cannot check the CUDA libraries")]
    missing, outside, good = [], [], []
    for pin in pins:
        have = installed.get(pin.name)
        if have is None:
            missing.append(pin.name)
        elif not _within(have, pin):
            outside.append(f"{pin.name} {have} outside {pin.specifier}")
        elif pin.name.split("-")[1] in ("cudnn", "nccl", "cuda"):
            good.append(f"{pin.name} {have}")
    if missing or outside:
        found = ([f"{len(missing)} of {len(pins)} missing ({', '.join(missing)})"] if missing else []) + outside
        return [Check("FAIL", name, "; ".join(found), f"pip install 'tensorflow[and-cuda]=={TF_VERSION}'")]
    return [Check("OK", name, f"{len(pins)} nvidia-* packages within TensorFlow {TF_VERSION}'s pins ({', '.join(good)})")]


def _within(version: str, pin: Requirement) -> bool:
    try:
        return pin.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def cuda_major(build: dict[str, Any], requirements: list[str]) -> int | None:
    """The CUDA major version TensorFlow needs: its build info, else its nvidia-*-cuXX pins."""
    version = str(build.get("cuda_version", ""))
    if version[:2].isdigit():
        return int(version.split(".")[0])
    for line in requirements:
        pin = Requirement(line)
        if pin.name.startswith("nvidia-cuda-runtime-cu"):
            return int(pin.name.rsplit("-cu", 1)[1])
    return None


def driver(smi: Smi, major: int | None) -> list[Check]:
    name = "nvidia.driver"
    if not smi.found:
        return [Check("INFO", name, "nvidia-smi not found: no NVIDIA driver, the workers train on the CPU")]
    if smi.error:
        return [
            Check(
                "FAIL",
                name,
                f"nvidia-smi failed: {smi.error}",
                "install or reload the NVIDIA driver (nvidia-smi must list the GPUs)",
            )
        ]
    if not smi.gpus:
        return [Check("INFO", name, "nvidia-smi lists no GPU: the workers train on the CPU")]
    found = smi.gpus[0].driver
    need = MIN_DRIVER.get(major or 0)
    if need and _version_tuple(found) < _version_tuple(need):
        return [
            Check(
                "FAIL",
                name,
                f"driver {found} is older than {need}, the oldest that runs CUDA {major} (which TensorFlow {TF_VERSION} needs)",
                f"install an NVIDIA driver >= {need}",
            )
        ]
    gpus = ", ".join(f"{g.index}: {g.name}" for g in smi.gpus)
    return [Check("OK", name, f"driver {found}" + (f" (>= {need} for CUDA {major})" if need else "") + f"; GPUs {gpus}")]


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def interconnect(smi: Smi) -> list[Check]:
    return [
        Check(
            "INFO",
            "gpu.interconnect",
            "multi-GPU training needs no SLI or NVLink bridge: CUDA drives each GPU on its own, and pstrain's "
            "workers exchange gradients through the ps over the network stack, not GPU to GPU"
            + (f" ({len(smi.gpus)} GPUs here)" if smi.gpus else ""),
        )
    ]


def ports(results: dict[str, str]) -> list[Check]:
    """`results`: task -> "" when its fixed port is free, "auto" for port 0, else the error."""
    out = []
    for task, error in sorted(results.items()):
        if error and error != "auto":
            out.append(Check("FAIL", f"port.{task}", error, "stop what holds it, or pick another port (0: a free one)"))
    free = [t for t, e in results.items() if not e]
    auto = [t for t, e in results.items() if e == "auto"]
    if not out:
        text = (f"fixed ports free ({', '.join(sorted(free))})" if free else "no fixed port") + (
            f"; {len(auto)} picked at launch (port 0)" if auto else ""
        )
        out.append(Check("OK", "ports", text))
    return out


def hosts(results: dict[str, str]) -> list[Check]:
    """`results`: host -> "local", "reachable", or why not ("cannot resolve ...", "no answer ...")."""
    out = []
    for host, state in sorted(results.items()):
        if state in ("local", "reachable"):
            out.append(
                Check("OK", f"host.{host}", "this machine" if state == "local" else "resolves and answers on its task port")
            )
        else:
            out.append(
                Check(
                    "FAIL",
                    f"host.{host}",
                    state,
                    "fix the address in the config, DNS/hosts, or the firewall between the machines",
                )
            )
    return out


def tf_config(value: str | None) -> list[Check]:
    if value is None:
        return [Check("OK", "env.TF_CONFIG", "not set (pstrain launch gives every task its own)")]
    return [
        Check(
            "WARN",
            "env.TF_CONFIG",
            f"set in this environment ({value[:60]}{'...' if len(value) > 60 else ''}); `pstrain server` and TensorFlow's "
            "resolvers use it as is",
            "unset TF_CONFIG unless a cluster manager (TFJob, Slurm) set it for this task",
        )
    ]


CHECKPOINTS_OF_ROOM = 3  # a save writes a whole new checkpoint before the oldest kept one is deleted


def run_dir(path: str, writable: str, free_bytes: int, checkpoint_bytes: int = 0, min_free: int = 1 << 30) -> list[Check]:
    """`writable`: "" when a file could be written there, else why not; `checkpoint_bytes`: the size of
    the newest checkpoint there (0: none yet)."""
    name = "run_dir"
    if writable:
        return [Check("FAIL", name, f"{path}: cannot write ({writable})", "choose a writable --run-dir")]
    gib = free_bytes / (1 << 30)
    if free_bytes < min_free:
        return [Check("FAIL", name, f"{path}: only {gib:.2f} GiB free", "free disk space or choose another --run-dir")]
    if free_bytes < CHECKPOINTS_OF_ROOM * checkpoint_bytes:
        size = checkpoint_bytes / (1 << 30)
        return [
            Check(
                "WARN",
                name,
                f"{path}: {gib:.1f} GiB free, less than {CHECKPOINTS_OF_ROOM} checkpoints of {size:.1f} GiB",
                "free disk space or choose another --run-dir: a full disk stops the run at its last checkpoint",
            )
        ]
    return [Check("OK", name, f"{path}: writable, {gib:.1f} GiB free")]


def exposure(interface_addresses: list[str], task_hosts: dict[str, str]) -> list[Check]:
    """TensorFlow binds every server to 0.0.0.0: any public address of this machine exposes its ports.

    `task_hosts`: task -> the IP its configured host resolves to."""
    public = sorted(a for a in interface_addresses if _is_public(a))
    public_tasks = sorted(t for t, ip in task_hosts.items() if _is_public(ip))
    if not public and not public_tasks:
        return [
            Check("OK", "network.exposure", "every address here is private or loopback (TensorFlow's ports listen on 0.0.0.0)")
        ]
    where = ", ".join(public) or ", ".join(f"{t} at {task_hosts[t]}" for t in public_tasks)
    return [
        Check(
            "WARN",
            "network.exposure",
            f"TensorFlow's servers listen on 0.0.0.0 without authentication: their ports are open on the public address {where}",
            "firewall the TensorFlow ports to the cluster's own hosts, or use a private network",
        )
    ]


def _is_public(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return ip.is_global


def cluster_versions(local: dict[str, str], tasks: list[dict[str, Any]]) -> list[Check]:
    """Every registered task runs this machine's pstrain/TensorFlow/Python."""
    registered = [t for t in tasks if t.get("state") != "missing"]
    differ = []
    for task in registered:
        theirs = task.get("versions") or {}
        skew = [f"{k} {theirs.get(k, '?')}" for k, v in local.items() if theirs and theirs.get(k) != v]
        if skew:
            differ.append(f"{task['task']} runs {', '.join(skew)}")
    if differ:
        mine = ", ".join(f"{k} {v}" for k, v in local.items())
        return [
            Check("FAIL", "cluster.versions", f"{'; '.join(differ)} (here: {mine})", "install the same versions on every machine")
        ]
    if not any(t.get("versions") for t in registered):
        return [Check("WARN", "cluster.versions", "the chief reports no versions (an older pstrain)", "upgrade the chief")]
    return [
        Check(
            "OK", "cluster.versions", f"{len(registered)} registered tasks run " + ", ".join(f"{k} {v}" for k, v in local.items())
        )
    ]


def clock_and_latency(round_trips_s: list[float], skew_s: float | None, chief: str) -> list[Check]:
    out = []
    rtt_ms = 1000 * sorted(round_trips_s)[len(round_trips_s) // 2]
    level = "OK" if rtt_ms < 50 else "WARN"
    fix = "" if level == "OK" else "put the machines on one fast network: every step makes several round trips"
    out.append(Check(level, "cluster.round_trip", f"median round trip to the chief at {chief}: {rtt_ms:.1f} ms", fix))
    if skew_s is None:
        out.append(Check("WARN", "cluster.clock", "the chief reports no clock (an older pstrain)", "upgrade the chief"))
    elif abs(skew_s) > 1.0:
        out.append(
            Check(
                "WARN",
                "cluster.clock",
                f"this machine's clock is {skew_s:+.2f} s off the chief's; log and metric times will not line up",
                "run NTP (chrony / systemd-timesyncd) on every machine",
            )
        )
    else:
        out.append(Check("OK", "cluster.clock", f"clock within {abs(skew_s) * 1000:.0f} ms of the chief's"))
    return out


def task_round_trips(results: dict[str, float | str]) -> list[Check]:
    """`results`: registered task -> median TCP connect seconds to its TF server, or why none."""
    out = []
    for task, result in sorted(results.items()):
        name = f"cluster.round_trip.{task}"
        if isinstance(result, str):
            out.append(Check("FAIL", name, result, "check the firewall between this machine and that task's host"))
        else:
            level = "OK" if result < 0.05 else "WARN"
            fix = "" if level == "OK" else "put the machines on one fast network: every step makes several round trips"
            out.append(Check(level, name, f"TCP connect to its TensorFlow server: {result * 1000:.1f} ms", fix))
    return out


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.level == "FAIL" for c in checks) else 0
