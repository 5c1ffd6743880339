"""Slurm: host lists and task counts from SLURM_* (pure), `pstrain render slurm`, and the rendered
srun command end to end on two network namespaces, each a node with the variables Slurm sets."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from chief.jobs import digits
from cluster.config import ConfigError, resolve
from cluster.launch.launcher import shared_control_env
from cluster.launch.ports import free_port
from cluster.launch.slurm_node import slurm_config
from cluster.render.sbatch import SRUN, SlurmOptions, render_sbatch
from cluster.rundir import RunDir
from cluster.slurm import assigned_gpus, expand_hostlist, expand_tasks_per_node, slurm_node
from tests.helpers import (
    Result,
    alive,
    assert_both_workers_each_step,
    assert_no_orphans,
    descendant_pids,
    metrics,
    predictions,
    run_pstrain,
)
from tests.netns import can_create_namespaces, lan


@pytest.mark.pure
def test_hostlists_keep_slurms_order_and_zero_padding():
    assert expand_hostlist("node[9-10]") == ["node9", "node10"]  # not sorted as text
    assert expand_hostlist("gpu[01-03,07]") == ["gpu01", "gpu02", "gpu03", "gpu07"]
    assert expand_hostlist("login1,gpu[9-10]x,rack[1-2]-n[1-2]") == [
        "login1",
        "gpu9x",
        "gpu10x",
        "rack1-n1",
        "rack1-n2",
        "rack2-n1",
        "rack2-n2",
    ]
    assert expand_hostlist("node[098-101]") == ["node098", "node099", "node100", "node101"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("1") == [1]


@pytest.mark.pure
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: expand_hostlist("node[9-"), "SLURM_JOB_NODELIST: unclosed '\\['"),
        (lambda: expand_hostlist("node[a-b]"), "SLURM_JOB_NODELIST: 'a-b' in 'node\\[a-b\\]' is not a number or range"),
        (lambda: expand_hostlist("node[3-1]"), "SLURM_JOB_NODELIST: range '3-1' .* runs backwards"),
        (lambda: expand_hostlist("n1,n1"), "SLURM_JOB_NODELIST: 'n1,n1' names a host twice"),
        (lambda: expand_hostlist("n[],m1"), "SLURM_JOB_NODELIST: empty host name or range"),
        (lambda: expand_hostlist("", "SLURM_STEP_NODELIST"), "SLURM_STEP_NODELIST: empty"),
        (lambda: expand_tasks_per_node("2(x)"), "SLURM_TASKS_PER_NODE: '2\\(x\\)' in '2\\(x\\)' is not N or N\\(xM\\)"),
        (lambda: assigned_gpus({"CUDA_VISIBLE_DEVICES": "GPU-3f2a"}), "CUDA_VISIBLE_DEVICES: 'GPU-3f2a'"),
    ],
)
def test_bad_variables_give_one_line_naming_the_variable(call, message):
    with pytest.raises(ConfigError, match=message) as e:
        call()
    assert "\n" not in str(e.value)


def env_for(node_id: int, nodelist: str = "node[9-10]", count: int = 2, **extra: str) -> dict[str, str]:
    """What Slurm sets in the task of one node of `srun --ntasks-per-node=1` (the parts pstrain reads)."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(count),
        "SLURM_TASKS_PER_NODE": f"1(x{count})",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": str(count),
        "SLURM_STEP_TASKS_PER_NODE": f"1(x{count})",
        "SLURM_NODEID": str(node_id),
        "SLURM_PROCID": str(node_id),
        **extra,
    }


@pytest.mark.pure
def test_each_node_derives_its_tasks_the_chief_on_the_first_node():
    cluster = resolve({"cluster": {"ps": 1, "workers": 2}}).cluster
    first = slurm_node(env_for(0), cluster)
    second = slurm_node(env_for(1, SLURM_STEP_GPUS="3", CUDA_VISIBLE_DEVICES="0"), cluster)
    assert first.runs_chief and not second.runs_chief
    assert first.cluster.chief == "node9:2222" and first.cluster.control == "node9:2223"
    assert first.cluster.ps == ("node9:2224",) and first.cluster.workers == ("node9:2225", "node10:2226")
    assert second.cluster.workers == first.cluster.workers, "every node computes the same addresses"
    assert first.local_tasks == {("ps", 0), ("worker", 0)} and second.local_tasks == {("worker", 1)}
    assert first.cluster.worker_gpus == (None, None), "no GPUs assigned: CPU workers"
    assert second.cluster.worker_gpus == (None, 0), "CUDA_VISIBLE_DEVICES as Slurm set it for this step wins"


@pytest.mark.pure
def test_gpus_come_from_what_slurm_assigned():
    cluster = resolve({"cluster": {"ps": 2, "workers": 4}}).cluster
    node = slurm_node(env_for(1, "gpu[01-02]", SLURM_JOB_GPUS="4,6"), cluster)
    assert node.local_tasks == {("ps", 1), ("worker", 2), ("worker", 3)}
    assert node.cluster.worker_gpus == (None, None, 4, 6)
    assert assigned_gpus({"SLURM_STEP_GPUS": "1,2", "SLURM_JOB_GPUS": "0,1,2,3"}) == ("SLURM_STEP_GPUS", [1, 2])
    assert assigned_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ("", [])
    with pytest.raises(ConfigError, match="SLURM_JOB_GPUS: this node has 1 GPUs for 2 workers"):
        slurm_node(env_for(0, "gpu[01-02]", SLURM_JOB_GPUS="4"), cluster)


@pytest.mark.pure
@pytest.mark.parametrize(
    "env, message",
    [
        (env_for(0, SLURM_STEP_TASKS_PER_NODE="2(x2)"), "SLURM_STEP_TASKS_PER_NODE: '2\\(x2\\)'; run one pstrain node per node"),
        (env_for(0, SLURM_STEP_NUM_NODES="3"), "SLURM_STEP_NUM_NODES: 3 but SLURM_STEP_NODELIST names 2 nodes"),
        ({k: v for k, v in env_for(0).items() if k != "SLURM_NODEID"}, "SLURM_NODEID: expected a number, got ''"),
        (env_for(2), "SLURM_NODEID: 2 but SLURM_STEP_NODELIST names 2 nodes"),
        ({}, "SLURM_NODELIST: empty; run under Slurm"),
        (env_for(0, "n[1-3]", 3), "cluster.workers: 2 workers on 3 nodes leave a node idle"),
    ],
)
def test_inconsistent_slurm_variables_are_refused(env, message):
    with pytest.raises(ConfigError, match=message):
        slurm_node(env, resolve({}).cluster)


@pytest.mark.pure
def test_ports_must_fit():
    with pytest.raises(ConfigError, match="--port-base: 65533 puts the ports at 65533-65537; give a base from 1024 to 65531"):
        slurm_node(env_for(0), resolve({}).cluster, port_base=65533)


@pytest.mark.pure
@pytest.mark.parametrize(
    "tls, ca",
    [
        ({"tls_cert": "/pki/chief.pem", "tls_key": "/pki/chief.key", "tls_ca": "/pki/ca.pem"}, "/pki/ca.pem"),
        ({"tls_cert": "/pki/chief.pem", "tls_key": "/pki/chief.key"}, "/pki/chief.pem"),  # self-signed: trust the cert
    ],
)
def test_a_second_nodes_tasks_get_the_token_and_tls_ca_of_the_control_plane(tmp_path, tls, ca):
    (tmp_path / "token").write_text("s3cret\n")
    raw = {"cluster": {"ps": 1, "workers": 2, "token_file": str(tmp_path / "token"), **tls}, "train": {"run_dir": "/shared"}}
    config, _, runs_chief = slurm_config(raw, env_for(1))
    assert not runs_chief
    assert shared_control_env(config) == {
        "PSTRAIN_CONTROL": "node9:2223",
        "PSTRAIN_HEARTBEAT_INTERVAL": "2.0",
        "PSTRAIN_HEARTBEAT_TIMEOUT": "10.0",
        "PSTRAIN_REGISTER_TIMEOUT": "60.0",
        "PSTRAIN_TOKEN": "s3cret",
        "PSTRAIN_TLS_CA": ca,
    }


@pytest.mark.cluster
def test_rendered_sbatch_script(tmp_path):
    config = tmp_path / "cluster.toml"
    config.write_text('[cluster]\nps = 1\nworkers = 4\n\n[train]\nrun_dir = "/shared/runs/digits"\n')
    out = tmp_path / "job.sbatch"
    flags = ["--gpus-per-node", "2", "--time", "02:00:00", "-o", str(out)]
    result = run_pstrain(["render", "slurm", "--config", str(config), *flags])
    assert result.returncode == 0, result.output
    script = out.read_text()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --time=02:00:00",
        "#SBATCH --signal=B:TERM@120",
        f"{SRUN} pstrain node --slurm --config {config} --port-base 2222 &",
        """trap 'stopped=143; pstrain stop --chief "$first_node:2223" || true' TERM""",
        'exit "${stopped:-0}"',
    ):
        assert line in script.splitlines(), line
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0, "the script parses"
    with pytest.raises(ConfigError, match="--gpus-per-node: 1 is fewer than the 2 workers per node"):
        four = resolve({"cluster": {"workers": 4}, "train": {"run_dir": "r"}})
        render_sbatch(four, SlurmOptions("c", nodes=2, gpus_per_node=1))
    with pytest.raises(ConfigError, match="train.run_dir: not set"):
        render_sbatch(resolve({}), SlurmOptions("c"))


# End to end: two network namespaces are the nodes pstnode9 and pstnode10.

WHY_NOT = can_create_namespaces()
CONFIG = """\
[cluster]
ps = 1
workers = 2
heartbeat_interval = 0.5

[train]
steps = 20
checkpoint_every = 10
startup_timeout = 120.0
run_dir = "{run_dir}"
"""


def srun_command(script: str) -> list[str]:
    """The command the rendered script's srun line starts on every node."""
    [line] = [line for line in script.splitlines() if line.startswith(SRUN)]
    return shlex.split(line[len(SRUN) :].rstrip(" &"))


@pytest.mark.netns
@pytest.mark.skipif(bool(WHY_NOT), reason=f"cannot create network namespaces here: {WHY_NOT}")
def test_slurm_end_to_end_on_two_namespaces(tmp_path):
    config = tmp_path / "cluster.toml"
    run_dir = tmp_path / "run"
    config.write_text(CONFIG.format(run_dir=run_dir))
    result = run_pstrain(["render", "slurm", "--config", str(config), "--gpus-per-node", "0", "-o", str(tmp_path / "job.sbatch")])
    assert result.returncode == 0, result.output
    command = srun_command((tmp_path / "job.sbatch").read_text())
    assert command[:3] == ["pstrain", "node", "--slurm"]
    # The config's node view as each node will compute it: the chief on pstnode9, listed first.
    config_view, _, _ = slurm_config({"cluster": {"ps": 1, "workers": 2}, "train": {"run_dir": "r"}}, env_for(0, "pstnode[9-10]"))
    assert config_view.cluster.workers == ("pstnode9:2225", "pstnode10:2226")
    venv_bin = str(Path(sys.executable).parent)
    processes, seen = [], set()
    with lan("pstslurm-", {"n9": ["pstnode9"], "n10": ["pstnode10"]}, "10.253.5") as hosts:
        try:
            for node_id, label in enumerate(("n9", "n10")):
                env = {
                    "PATH": f"{venv_bin}:/usr/bin:/bin",
                    "HOME": str(tmp_path),
                    "PSTRAIN_TOKEN": "job-4242-token",  # the batch script exports it; srun passes it on
                    "SLURMD_NODENAME": f"pstnode{9 + node_id}",
                    **env_for(node_id, "pstnode[9-10]"),
                }
                out = open(tmp_path / f"{label}.out", "w")
                processes.append(
                    subprocess.Popen(hosts[label].command(command), cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
                )
            deadline = time.monotonic() + 300
            record = None  # control.json as the first node's launcher writes it (pstrain status --run-dir reads it)
            while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
                seen |= descendant_pids(p.pid for p in processes)
                if record is None and (run_dir / "control.json").exists():
                    record = json.loads((run_dir / "control.json").read_text())
                time.sleep(0.2)
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                p.wait()
            for p in alive(seen):
                p.kill()
    outputs = [(tmp_path / f"{label}.out").read_text() for label in ("n9", "n10")]
    assert [p.returncode for p in processes] == [0, 0], "\n---\n".join(o[-3000:] for o in outputs)
    assert_no_orphans(Result(0, "", seen | {p.pid for p in processes}))
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(h.namespace in after for h in hosts.values()), "the test removes its namespaces"
    records, done = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(20)) and done is not None
    assert_both_workers_each_step(records, first_steps=(0,))  # both nodes' workers
    assert "running worker-1 at pstnode10:2226" in outputs[1]
    assert "registered with the control plane at pstnode9:2223" in (run_dir / "logs" / "worker-1.log").read_text()
    # The token came from $PSTRAIN_TOKEN (the batch script's): the record names no file, only where to call.
    assert record is not None and (record["target"], record["engine"], record["token_file"]) == ("pstnode9:2223", "slurm", "")
    assert not (run_dir / "control.json").exists(), "removed when the launch ended"


# A real single-node Slurm (slurmctld + slurmd + munge from the distribution), started by the test.

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo")
SLURM_CONF = """\
ClusterName=psttest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
PlugStackConfig={dir}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def why_no_slurm() -> str:
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "slurmd runs jobs as other users only as root"
    return ""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """munged, slurmctld and slurmd on loopback, in a folder of their own; stopped and reaped after."""
    folder = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool"):
        (folder / sub).mkdir()
    (folder / "munge").chmod(0o700)
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    (folder / "plugstack.conf").write_text("")
    conf = folder / "slurm.conf"
    conf.write_text(SLURM_CONF.format(dir=folder, ctld_port=free_port("127.0.0.1"), slurmd_port=free_port("127.0.0.1")))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munge = folder / "munge"
    daemons = [
        ["munged", "-F", "-f", f"--socket={munge}/munge.sock", f"--key-file={key}", f"--pid-file={munge}/munged.pid"]
        + [f"--log-file={folder}/munged.log", f"--seed-file={munge}/seed"],
        ["slurmctld", "-D", "-i", "-f", str(conf)],
        ["slurmd", "-D", "-f", str(conf), "-N", "localhost"],
    ]
    processes = []
    try:
        for argv in daemons:
            processes.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            time.sleep(1)
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline and state != "idle":
            sinfo = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=30)
            state = sinfo.stdout.strip()
            time.sleep(0.5)
        assert state == "idle", f"the test's Slurm did not come up: {(folder / 'slurmctld.log').read_text()[-2000:]}"
        yield env
    finally:
        for p in reversed(processes):
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def submit(script: Path, env: dict) -> str:
    argv = ["sbatch", "--parsable", str(script)]
    job = subprocess.run(argv, cwd=script.parent, env=env, capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    return job.stdout.strip()


def wait_for(env: dict, job: str, deadline: float) -> dict[str, str]:
    """The job's final state (polled every 0.5 s; `sbatch --wait` polls far less often)."""
    while time.monotonic() < deadline and job_state(env, job).get("JobState") in ("PENDING", "RUNNING", "COMPLETING"):
        time.sleep(0.5)
    return job_state(env, job)


def job_state(env: dict, job: str) -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True, timeout=30).stdout
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


@pytest.mark.cluster
@pytest.mark.skipif(bool(why_no_slurm()), reason=f"no Slurm here: {why_no_slurm()}")
def test_real_slurm_sbatch_stops_with_a_checkpoint_on_the_time_limit_signal_and_resumes(tmp_path, slurm):
    run_dir = tmp_path / "run"
    config = tmp_path / "cluster.toml"
    # 600 steps: long enough that the batch shell's `pstrain stop` (a Python start, seconds on a loaded
    # machine) reaches the chief before the run ends by itself (at 120 it finished first under CI's load)
    config.write_text(CONFIG.format(run_dir=run_dir).replace("steps = 20", "steps = 600").replace("every = 10", "every = 40"))
    script = tmp_path / "job.sbatch"
    flags = ["--nodes", "1", "--gpus-per-node", "0", "--time", "00:10:00", "-o", str(script)]
    result = run_pstrain(["render", "slurm", "--config", str(config), *flags])
    assert result.returncode == 0, result.output
    env = {**slurm, "PATH": f"{Path(sys.executable).parent}:{slurm['PATH']}"}
    job_id = submit(script, env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(metrics(run_dir)[0] if RunDir(run_dir).metrics.exists() else []) < 20:
        time.sleep(0.2)
    # What --signal=B:TERM@120 does before the time limit: SIGTERM to the batch shell.
    subprocess.run(["scancel", "--batch", "--signal=TERM", job_id], env=env, check=True, timeout=30)
    state = wait_for(env, job_id, deadline)
    output = (tmp_path / f"pstrain-{job_id}.out").read_text()
    assert state.get("ExitCode") == "143:0", f"{state}\n{output[-3000:]}"
    assert "checkpoint saved, run the same command to resume" in output
    stopped_at = len(metrics(run_dir)[0])
    assert 20 <= stopped_at < 600 and (run_dir / "checkpoints" / f"ckpt-{stopped_at}.index").exists()
    again = submit(script, env)
    state = wait_for(env, again, time.monotonic() + 300)
    assert state.get("ExitCode") == "0:0", f"{state}\n{(tmp_path / f'pstrain-{again}.out').read_text()[-3000:]}"
    records, done = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(600)) and done is not None
    assert "resumed" in (run_dir / "logs" / "chief-0.log").read_text()
    left = [p for p in psutil.process_iter(["cmdline"]) if str(config) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes left running: {[p.pid for p in left]}"
    reference = tmp_path / "standalone"
    result = run_pstrain(["train", "--standalone", "--run-dir", str(reference), "--steps", "600"])
    assert result.returncode == 0, result.output
    features = digits.eval_data()[0]
    np.testing.assert_allclose(predictions(run_dir, features), predictions(reference, features), atol=1e-4, rtol=0)
