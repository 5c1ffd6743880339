"""`pstrain doctor`: the checks as pure functions, and the command against fake nvidia-smi scripts.

No GPU exists here, so GPU machines are played by a fake `nvidia-smi` first on PATH (no GPU, two
GPUs, an old driver, memory held by another process). The per-worker probe still runs TensorFlow
for real under each worker's CUDA_VISIBLE_DEVICES, so on this CPU-only machine it must say that
TensorFlow sees no GPU there (and never pretend otherwise).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import textwrap

import pytest

from cluster.control.registry import Registry
from cluster.control.security import Credentials
from cluster.control.service import ControlService, serve
from cluster.doctor import checks, gpus
from cluster.doctor.checks import Check, Gpu, GpuProcess, Probe, Smi
from cluster.doctor.run import cluster_checks
from cluster.rundir import checkpoint_bytes_within
from cluster.versions import local_versions
from tests.helpers import PSTRAIN, ROOT

H100 = "NVIDIA H100 80GB HBM3"
PINS = [
    'nvidia-cuda-runtime-cu12<13.0,>=12.5.82; extra == "and-cuda"',
    'nvidia-cudnn-cu12<10.0,>=9.3.0.75; extra == "and-cuda"',
    'nvidia-nccl-cu12<3.0,>=2.27.7; extra == "and-cuda"',
    'tensorflow-io-gcs-filesystem>=0.23.1; extra == "gcs-filesystem"',
]
CUDA_BUILD = {"is_cuda_build": "True", "cuda_version": "12.5.1", "cudnn_version": "9"}


def two_gpus(driver="550.54.15", used=(0, 0)) -> Smi:
    return Smi(True, "", tuple(Gpu(i, f"GPU-{i}", H100, driver, 81559, used[i]) for i in range(2)))


def levels(found: list[Check]) -> dict[str, str]:
    return {c.name: c.level for c in found}


# --- the checks, over facts -------------------------------------------------------------------


@pytest.mark.pure
def test_cpu_wheel_on_a_gpu_machine_fails_and_the_cuda_wheel_passes():
    found = checks.tensorflow_wheel({"tensorflow-cpu": "2.21.0"}, {"is_cuda_build": "False"}, two_gpus())
    assert found[0].level == "FAIL" and "CPU-only build but this machine has 2 GPU(s)" in found[0].message
    assert "bootstrap.sh" in found[0].fix
    assert checks.tensorflow_wheel({"tensorflow": "2.21.0"}, CUDA_BUILD, two_gpus())[0].level == "OK"
    assert checks.tensorflow_wheel({"tensorflow-cpu": "2.21.0"}, {}, Smi(False))[0].level == "OK"
    wrong = checks.tensorflow_wheel({"tensorflow": "2.20.0"}, CUDA_BUILD, two_gpus())[0]
    assert wrong.level == "FAIL" and "tensorflow 2.20.0 installed; pstrain needs 2.21.0" in wrong.message
    assert checks.tensorflow_wheel({}, {}, Smi(False))[0].level == "FAIL"


@pytest.mark.pure
def test_cuda_libraries_against_tensorflows_pins():
    good = {"nvidia-cuda-runtime-cu12": "12.5.82", "nvidia-cudnn-cu12": "9.3.0.75", "nvidia-nccl-cu12": "2.28.3"}
    ok = checks.cuda_libraries(PINS, good, CUDA_BUILD, two_gpus())
    assert ok[0].level == "OK" and "3 nvidia-* packages" in ok[0].message and "nvidia-cudnn-cu12 9.3.0.75" in ok[0].message
    old = checks.cuda_libraries(PINS, {**good, "nvidia-cudnn-cu12": "8.9.7.29"}, CUDA_BUILD, two_gpus())
    assert old[0].level == "FAIL" and "nvidia-cudnn-cu12 8.9.7.29 outside <10.0,>=9.3.0.75" in old[0].message
    missing = checks.cuda_libraries(PINS, {}, CUDA_BUILD, two_gpus())
    assert (
        missing[0].level == "FAIL"
        and missing[0].message.startswith("3 of 3 missing (")
        and "nvidia-nccl-cu12" in missing[0].message
    )
    assert checks.cuda_libraries(PINS, {}, {"is_cuda_build": "False"}, Smi(False))[0].level == "OK"


@pytest.mark.pure
def test_two_tensorflow_distributions_are_named_as_the_cause_with_a_fix_for_this_machine():
    """What `pip install .[ray]` left (issue 36): the full `tensorflow` (a CUDA build) over tensorflow-cpu on
    a machine without a GPU. The doctor names the two distributions as the cause and keeps the CPU one;
    it gives no CUDA advice where there is no GPU. On a GPU machine it keeps the CUDA one."""
    both = {"tensorflow": "2.21.0", "tensorflow-cpu": "2.21.0"}
    found = checks.tensorflow_wheel(both, CUDA_BUILD, Smi(False))
    assert found[0].level == "FAIL"
    assert "several TensorFlow distributions installed (tensorflow 2.21.0, tensorflow-cpu 2.21.0)" in found[0].message
    reinstall = "pip install --force-reinstall --no-deps"
    assert found[0].fix.startswith(f"pip uninstall -y tensorflow && {reinstall} 'tensorflow-cpu==2.21.0'")
    cuda = checks.cuda_libraries(PINS, {}, CUDA_BUILD, Smi(False))
    assert cuda[0].level == "OK" and "and-cuda" not in cuda[0].fix and cuda[0].message.startswith("not needed (no GPU)")
    on_gpus = checks.tensorflow_wheel(both, CUDA_BUILD, two_gpus())[0]
    assert on_gpus.fix.startswith(f"pip uninstall -y tensorflow-cpu && {reinstall} 'tensorflow==2.21.0'")


@pytest.mark.pure
def test_driver_old_new_missing_and_broken():
    assert checks.cuda_major({}, PINS) == 12 and checks.cuda_major(CUDA_BUILD, []) == 12
    old = checks.driver(two_gpus(driver="470.82.01"), 12)[0]
    assert old.level == "FAIL" and "470.82.01 is older than 525.60.13" in old.message
    assert checks.driver(two_gpus(), 12)[0].level == "OK"
    assert checks.driver(Smi(False), 12)[0].level == "INFO"
    broken = checks.driver(Smi(True, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"), 12)[0]
    assert broken.level == "FAIL" and "couldn't communicate" in broken.message


@pytest.mark.pure
def test_worker_gpus_exist_are_shared_safely_and_the_probe_is_believed():
    probes = {
        "worker-0": Probe("0", ("/physical_device:GPU:0",), matmul_device="/job:localhost/replica:0/task:0/device:GPU:0"),
        "worker-1": Probe("1", ()),
    }
    found = levels(gpus.worker_gpus({"worker-0": 0, "worker-1": 1}, two_gpus(), probes, wheel_is_cpu=False))
    assert found == {"gpu.worker-0": "OK", "gpu.worker-1": "FAIL"}
    shared = gpus.worker_gpus({"worker-0": 1, "worker-1": 1, "worker-2": 7}, two_gpus(), {}, False)
    assert [c.message for c in shared] == [
        "GPU 1 is shared by worker-0, worker-1 (memory growth on)",
        "GPU 1 is shared by worker-0, worker-1 (memory growth on)",
        "GPU 7 does not exist (nvidia-smi lists GPUs [0, 1])",
    ]
    capacity = two_gpus().gpus[1].memory_total_mib
    fits = gpus.worker_gpus({"worker-0": 1, "worker-1": 1}, two_gpus(), {}, False, memory_mb=capacity // 2)
    assert {c.level for c in fits} == {"INFO"} and f"{capacity // 2} MiB each" in fits[0].message
    over = gpus.worker_gpus({"worker-0": 1, "worker-1": 1}, two_gpus(), {}, False, memory_mb=capacity // 2 + 1)
    assert {c.level for c in over} == {"FAIL"} and f"at most {capacity // 2}" in over[0].fix
    two = gpus.worker_gpus({"worker-0": 0}, two_gpus(), {"worker-0": Probe("0,1", ("a", "b"))}, False)[0]
    assert two.level == "FAIL" and "sees 2 GPUs" in two.message


@pytest.mark.pure
def test_a_mix_of_gpu_and_cpu_workers_is_said_and_a_cpu_machine_is_only_informed():
    mixed = {c.name: c for c in gpus.worker_gpus({"worker-0": 0, "worker-1": None}, two_gpus(), {}, False)}
    assert mixed["gpu.worker-1"].level == "WARN" and "runs at its pace" in mixed["gpu.worker-1"].message
    alone = gpus.worker_gpus({"worker-0": None, "worker-1": None}, Smi(True, ""), {}, False)
    assert [c.level for c in alone] == ["INFO", "INFO"] and "beside" not in alone[0].message


@pytest.mark.pure
def test_memory_held_by_other_processes_warns():
    smi = Smi(True, "", two_gpus(used=(5, 70000)).gpus, (GpuProcess("GPU-1", 4242, "python", 69990),))
    found = gpus.gpu_memory(smi)
    assert [c.name for c in found] == ["gpu.memory.1"] and found[0].level == "WARN"
    assert "69990 of 81559 MiB on GPU 1" in found[0].message and "pid 4242 python" in found[0].message
    assert gpus.gpu_memory(two_gpus())[0].level == "OK"


@pytest.mark.pure
def test_network_environment_and_disk_checks():
    assert checks.ports({"ps-0": "", "worker-0": "auto"})[0].level == "OK"
    taken = checks.ports({"ps-0": "127.0.0.1:2222: cannot listen on 127.0.0.1:2222 (Address already in use)"})
    assert taken[0].level == "FAIL" and taken[0].name == "port.ps-0"
    assert levels(checks.hosts({"127.0.0.1": "local", "node9": "cannot resolve node9 (Name or service not known)"})) == {
        "host.127.0.0.1": "OK",
        "host.node9": "FAIL",
    }
    assert checks.tf_config(None)[0].level == "OK" and checks.tf_config('{"cluster": {}}')[0].level == "WARN"
    assert checks.run_dir("runs", "", 10 << 30)[0].level == "OK"
    assert checks.run_dir("runs", "Permission denied", 0)[0].level == "FAIL"
    assert checks.run_dir("runs", "", 1 << 20)[0].level == "FAIL"
    assert checks.run_dir("runs", "", 10 << 30, checkpoint_bytes=3 << 30)[0].level == "OK"
    few = checks.run_dir("runs", "", 5 << 30, checkpoint_bytes=2 << 30)[0]
    assert (few.level, few.message) == ("WARN", "runs: 5.0 GiB free, less than 3 checkpoints of 2.0 GiB")


@pytest.mark.pure
def test_checkpoint_bytes_is_the_newest_checkpoints_size(tmp_path):
    """Found in a run dir, or in the run dirs inside the doctor's `runs`."""
    assert checkpoint_bytes_within(tmp_path) == 0
    old, new = tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints"
    for directory, step, size in ((old, 10, 5000), (new, 20, 300)):
        directory.mkdir(parents=True)
        (directory / f"ckpt-{step}.data-00000-of-00001").write_bytes(b"\0" * size)
        (directory / f"ckpt-{step}.index").write_bytes(b"\0" * 100)
    os.utime(old / "ckpt-10.index", (1, 1))  # b's is the newest
    assert checkpoint_bytes_within(tmp_path) == 400
    assert checkpoint_bytes_within(tmp_path / "a") == 5100
    assert checks.exposure(["127.0.0.1", "10.0.0.5", "192.168.1.2", "fe80::1"], {"worker-0": "10.0.0.5"})[0].level == "OK"
    public = checks.exposure(["10.0.0.5", "8.8.8.8"], {})[0]
    assert public.level == "WARN" and "8.8.8.8" in public.message
    assert checks.exposure([], {"worker-1": "8.8.4.4"})[0].level == "WARN"
    sli = checks.interconnect(two_gpus())[0]
    assert sli.level == "INFO" and "no SLI or NVLink bridge" in sli.message


@pytest.mark.pure
def test_cluster_versions_clock_and_round_trip():
    mine = {"pstrain": "1.0", "tensorflow": "2.21.0", "python": "3.11.7"}
    tasks = [{"task": "chief:0", "state": "training", "versions": mine}, {"task": "worker:1", "state": "missing"}]
    assert checks.cluster_versions(mine, tasks)[0].level == "OK"
    other = [{"task": "worker:0", "state": "serving", "versions": {**mine, "tensorflow": "2.20.0"}}]
    skew = checks.cluster_versions(mine, other)[0]
    assert skew.level == "FAIL" and "worker:0 runs tensorflow 2.20.0" in skew.message
    found = levels(checks.clock_and_latency([0.002, 0.001, 0.003], 0.01, "h:1"))
    assert found == {"cluster.round_trip": "OK", "cluster.clock": "OK"}
    found = levels(checks.clock_and_latency([0.2, 0.3, 0.25], -4.2, "h:1"))
    assert found == {"cluster.round_trip": "WARN", "cluster.clock": "WARN"}
    trips = levels(checks.task_round_trips({"ps:0": 0.0004, "worker:1": 0.08, "worker:2": "cannot connect to h:3 (x)"}))
    assert trips == {
        "cluster.round_trip.ps:0": "OK",
        "cluster.round_trip.worker:1": "WARN",
        "cluster.round_trip.worker:2": "FAIL",
    }


@pytest.mark.pure
def test_cluster_checks_against_a_real_control_plane():
    """--chief: the Status RPC of a real control-plane server (gRPC on loopback)."""
    listening, closed = socket.socket(), socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: a registered task whose server is gone
    up, down = (f"127.0.0.1:{s.getsockname()[1]}" for s in (listening, closed))
    expected = {("chief", 0): "127.0.0.1:1", ("worker", 0): up, ("worker", 1): down}
    registry = Registry(expected, local_versions(), heartbeat_timeout=10)
    registry.register(("worker", 0), "box", up, 42, local_versions(), [])
    registry.register(("worker", 1), "box", down, 43, local_versions(), [])
    creds = Credentials("secret-token")
    server, port = serve(ControlService(registry, 1.0, lambda reason: None, lambda hosts: ({}, [])), "127.0.0.1:0", creds)
    try:
        found = cluster_checks(f"127.0.0.1:{port}", creds)
        assert levels(found) == {
            "cluster.versions": "OK",
            "cluster.round_trip": "OK",
            "cluster.clock": "OK",
            "cluster.round_trip.worker:0": "OK",
            "cluster.round_trip.worker:1": "FAIL",
        }, found
        assert by_name([c.as_dict() for c in found])["cluster.round_trip.worker:1"]["message"].startswith(
            f"cannot connect to {down}"
        )
        refused = cluster_checks(f"127.0.0.1:{port}", Credentials("wrong"))
        assert refused[0].level == "FAIL" and "refused the token" in refused[0].message
    finally:
        server.stop(grace=0)
        listening.close()
        closed.close()


# --- the command, with a fake nvidia-smi --------------------------------------------------------


def fake_nvidia_smi(bin_dir, gpus: list[str], apps: list[str] = (), fail: str = "", code: int = 0):
    """An nvidia-smi that answers the doctor's two CSV queries (and -L) from fixed lines."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "gpus.csv").write_text("".join(f"{line}\n" for line in gpus))
    (bin_dir / "apps.csv").write_text("".join(f"{line}\n" for line in apps))
    script = bin_dir / "nvidia-smi"
    failure = f'echo "{fail}"; exit {code}' if fail else ""
    script.write_text(
        textwrap.dedent(f"""\
            #!/bin/sh
            {failure}
            case "$1" in
              --query-gpu=*) cat "{bin_dir}/gpus.csv" ;;
              --query-compute-apps=*) cat "{bin_dir}/apps.csv" ;;
              -L) cut -d, -f1 "{bin_dir}/gpus.csv" | sed 's/^/GPU /; s/$/: fake/' ;;
            esac
            """)
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def doctor(tmp_path, env: dict, config: str = "", *args: str) -> tuple[int, list[dict]]:
    argv = PSTRAIN + ["doctor", "--json", *args]
    if config:
        (tmp_path / "c.toml").write_text(config)
        argv += ["--config", str(tmp_path / "c.toml")]
    full_env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES")}
    result = subprocess.run(argv, cwd=ROOT, env={**full_env, **env}, capture_output=True, text=True, timeout=300)
    return result.returncode, json.loads(result.stdout)


def by_name(found: list[dict]) -> dict[str, dict]:
    return {c["name"]: c for c in found}


GPU_LINES = [f"{i}, GPU-{i}, {H100}, 550.54.15, 81559, 1" for i in range(2)]


@pytest.mark.cluster
def test_two_gpus_with_the_cpu_wheel_fail_honestly(tmp_path):
    env = fake_nvidia_smi(tmp_path / "bin", GPU_LINES)
    code, found = doctor(tmp_path, env, "[cluster]\nworker_gpus = [0, 1]\n")
    checks_ = by_name(found)
    assert code == 1
    assert checks_["tensorflow.wheel"]["level"] == "FAIL" and "2 GPU(s)" in checks_["tensorflow.wheel"]["message"]
    assert checks_["nvidia.driver"]["level"] == "OK" and "550.54.15" in checks_["nvidia.driver"]["message"]
    # The probe really ran TensorFlow under each worker's pinning: this machine has no GPU, so it says so.
    for i in (0, 1):
        assert checks_[f"gpu.worker-{i}"] == {
            "level": "FAIL",
            "name": f"gpu.worker-{i}",
            "message": f"TensorFlow sees no GPU under CUDA_VISIBLE_DEVICES={i}",
            "fix": checks.REINSTALL,
        }
    assert checks_["gpu.interconnect"]["level"] == "INFO" and checks_["gpu.memory"]["level"] == "OK"


@pytest.mark.cluster
def test_old_driver_busy_memory_shared_and_missing_gpu(tmp_path):
    listed = [f"0, GPU-0, {H100}, 470.82.01, 81559, 3", f"1, GPU-1, {H100}, 470.82.01, 81559, 70000"]
    env = fake_nvidia_smi(tmp_path / "bin", listed, apps=["GPU-1, 4242, python, 69990"])
    config = "[cluster]\nworkers = 3\nworker_gpus = [1, 1, 5]\nworker_gpu_memory_mb = 50000\n[train]\nglobal_batch_size = 66\n"
    code, found = doctor(tmp_path, env, config)
    checks_ = by_name(found)
    assert code == 1
    assert (
        checks_["nvidia.driver"]["level"] == "FAIL" and "470.82.01 is older than 525.60.13" in checks_["nvidia.driver"]["message"]
    )
    assert checks_["gpu.memory.1"]["level"] == "WARN" and "pid 4242 python 69990 MiB" in checks_["gpu.memory.1"]["message"]
    assert checks_["gpu.worker-2"]["message"] == "GPU 5 does not exist (nvidia-smi lists GPUs [0, 1])"
    too_much = "GPU 1 is shared by worker-0, worker-1 at 50000 MiB each, more than its 81559 MiB"
    shared = [c for c in found if c["message"] == too_much]
    assert len(shared) == 2 and all(c["level"] == "FAIL" and "at most 40779" in c["fix"] for c in shared)


@pytest.mark.cluster
def test_no_gpu_a_taken_port_an_unreachable_host_and_a_stray_tf_config(tmp_path):
    env = fake_nvidia_smi(tmp_path / "bin", [], fail="No devices were found", code=6)
    env["TF_CONFIG"] = '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}'
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = f'[cluster]\nps = ["127.0.0.1:{port}"]\nworkers = ["127.0.0.1:0", "no-such-host.invalid:2222"]\n'
        code, found = doctor(tmp_path, env, config)
    checks_ = by_name(found)
    assert code == 1
    assert checks_["nvidia.driver"] == {
        "level": "INFO",
        "name": "nvidia.driver",
        "message": "nvidia-smi lists no GPU: the workers train on the CPU",
        "fix": "",
    }
    assert checks_["tensorflow.wheel"]["level"] == "OK"
    assert checks_["port.ps-0"]["level"] == "FAIL" and f"127.0.0.1:{port}" in checks_["port.ps-0"]["message"]
    unresolved = checks_["host.no-such-host.invalid"]
    assert unresolved["level"] == "FAIL" and unresolved["message"].startswith("cannot resolve no-such-host.invalid")
    assert checks_["env.TF_CONFIG"]["level"] == "WARN" and checks_["run_dir"]["level"] == "OK"


@pytest.mark.cluster
def test_this_machine_text_output(tmp_path):
    """No nvidia-smi on PATH (this machine): one line per check, all fine, exit 0."""
    path = ":".join(p for p in os.environ["PATH"].split(":") if not os.path.exists(os.path.join(p, "nvidia-smi")))
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES")}
    result = subprocess.run(
        PSTRAIN + ["doctor"], cwd=ROOT, env={**env, "PATH": path}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert all(line.split()[0] in ("OK", "INFO", "WARN") for line in lines[:-1]), lines
    assert lines[-1].startswith("pstrain doctor: 0 FAIL") and "I0000" not in result.stdout + result.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("flag", ["--chief"])
def test_doctor_against_a_chief_that_is_not_there(tmp_path, flag):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, found = doctor(tmp_path, {"PSTRAIN_TOKEN": "x"}, "", flag, f"127.0.0.1:{port}")
    assert code == 1 and by_name(found)["cluster"]["message"].startswith(f"no control plane answers at 127.0.0.1:{port}")


@pytest.mark.cluster
@pytest.mark.parametrize("smi", ["absent", "no devices"])
def test_gpu_check_script_without_a_gpu_says_so_in_one_line(tmp_path, smi):
    path = ":".join(p for p in os.environ["PATH"].split(":") if not os.path.exists(os.path.join(p, "nvidia-smi")))
    env = {**os.environ, "PATH": path}
    if smi == "no devices":
        env.update(fake_nvidia_smi(tmp_path / "bin", [], fail="No devices were found", code=6))
    result = subprocess.run(
        [str(ROOT / "deploy" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "pstrain: error: gpu_check: no NVIDIA GPU found (nvidia-smi -L lists none); run it on a machine with a GPU and its driver"
    ]
