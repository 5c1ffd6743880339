"""`pstrain doctor`: gather the facts, run the checks, print one line per check (or JSON)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import psutil

from cluster import rulesets
from cluster.config import ConfigError, load_toml, parse_address, resolve
from cluster.doctor import checks, facts, gpus, reach
from cluster.doors import check_control_target, is_unix_target
from cluster.rundir import RunDir, checkpoint_bytes_within
from cluster.task_setup import cluster_spec
from cluster.taskenv import gpu_visibility
from cluster.tfconfig import tf_config_text

ANY_GPU = 1 << 20  # resolve explicit worker_gpus as given; the doctor itself says which index is missing


def machine_checks(config_file: str | None) -> list[checks.Check]:
    """Every check of this machine, and of the config (the defaults without one) on it."""
    smi = facts.nvidia_smi()
    dists = facts.distributions()
    requirements = facts.tf_requirements(dists)
    try:
        config_found, probes = config_checks(config_file, smi)
    except ConfigError as e:
        config_found, probes = [checks.Check("FAIL", "config", str(e), "fix the config file")], {}
    # The build info comes from a worker's probe where one ran, else from a probe of its own.
    any_probe = next(iter(probes.values()), None)
    build = (any_probe if any_probe and any_probe.build else facts.probe(gpu_visibility(), False)).build
    out = checks.tensorflow_wheel(dists, build, smi)
    out += checks.cuda_libraries(requirements, dists, build, smi)
    out += checks.driver(smi, checks.cuda_major(build, requirements))
    out += config_found
    out += gpus.gpu_memory(smi, frozenset({os.getpid()}))
    out += checks.interconnect(smi)
    out += checks.tf_config(tf_config_text())
    return out


def config_checks(config_file: str | None, smi: checks.Smi) -> tuple[list[checks.Check], dict[str, checks.Probe]]:
    """GPUs per worker (probed in a process each), ports, hosts, run dir and exposure of the config."""
    from cluster.config import is_local_host
    from cluster.launch.hosts import local_addresses

    raw = load_toml(config_file) if config_file else {}
    explicit = isinstance(raw.get("cluster", {}).get("worker_gpus"), list)
    config = resolve(raw, gpu_count=ANY_GPU if explicit else len(smi.gpus))
    cluster, local = config.cluster, local_addresses()
    spec = cluster_spec(cluster)
    addresses = {f"{kind}-{i}": a for kind, tasks in spec.items() for i, a in enumerate(tasks)}
    addresses["control"] = cluster.control
    parsed = {task: parse_address(task, a) for task, a in addresses.items()}
    here = {task for task, (host, _) in parsed.items() if is_local_host(host, local)}
    assigned = {f"worker-{i}": gpu for i, gpu in enumerate(cluster.worker_gpus) if f"worker-{i}" in here}
    indices = {g.index for g in smi.gpus}
    probes = {w: facts.probe(str(gpu), matmul=True) for w, gpu in assigned.items() if gpu is not None and gpu in indices}
    wheel_is_cpu = not any(str(p.build.get("is_cuda_build")) == "True" for p in probes.values())
    out = gpus.worker_gpus(assigned, smi, probes, wheel_is_cpu, cluster.worker_gpu_memory_mb)
    out += checks.ports({t: facts.port_state(*parsed[t]) for t in sorted(here)})
    hosts: dict[str, str] = {}
    for host, port in parsed.values():
        hosts.setdefault(host, facts.host_state(host, port, local))
    out += checks.hosts(hosts)
    run_dir = config.train.run_dir or "runs"
    out += checks.run_dir(run_dir, *facts.writable(Path(run_dir)), checkpoint_bytes_within(Path(run_dir)))
    interfaces = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs]
    out += checks.exposure(interfaces, {t: facts.resolve_ip(h) for t, (h, _) in parsed.items() if t != "control"})
    return out, probes


def cluster_checks(chief: str, creds) -> list[checks.Check]:
    import grpc

    from cluster.versions import local_versions

    check_control_target("--chief", chief)
    try:
        status, trips, skew = facts.chief_status(chief, creds)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            return [
                checks.Check(
                    "FAIL", "cluster", f"the chief at {chief} refused the token", "pass --token-file with the cluster's token"
                )
            ]
        return [
            checks.Check("FAIL", "cluster", f"no control plane answers at {chief} ({e.code().name})", "is the cluster running?")
        ]
    registered = {t["task"]: t["address"] for t in status["tasks"] if t.get("state") not in ("missing", "lost")}
    if is_unix_target(chief):  # a closed local cluster: its TF ports exist in its private namespace only
        trips_to_tasks = [checks.Check("INFO", "cluster.round_trip", "the tasks' TF ports are closed to this namespace")]
    else:
        trips_to_tasks = checks.task_round_trips({task: facts.connect_time(address) for task, address in registered.items()})
    return (
        checks.cluster_versions(local_versions(), status["tasks"]) + checks.clock_and_latency(trips, skew, chief) + trips_to_tasks
    )


def run_doors(run_dir: RunDir) -> list[checks.Check]:
    """`--run-dir`: every listening socket of the run's processes (the lock's holder and its
    descendants), read in each process's own network namespace, and who reaches it."""
    from cluster.doctor.listeners import listeners
    from cluster.runlock import read_holder

    holder = read_holder(run_dir)
    record = run_dir.config_record
    control = json.loads(record.read_text()).get("control") or "" if record.exists() else ""
    pids = []
    if holder is not None and psutil.pid_exists(holder.pid):
        root = psutil.Process(holder.pid)
        pids = [root.pid, *(p.pid for p in root.children(recursive=True))]
    commands = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            commands[pid] = " ".join(psutil.Process(pid).cmdline()[1:3])
    rules = guardians(pids)
    found = [(x.pid, commands.get(x.pid, "?"), x.address, x.port, reach.guarded(x.reach, x.port, rules)) for x in listeners(pids)]
    return reach.doors(found, control) + reach.node_rules(rules, control)


def guardians(pids: list[int]) -> list[reach.Guardian]:
    """The node rules' guardians among `pids` (`... -m cluster.launch.firewall guard TOOL PORTS PEERS`),
    each with whether its tool lists its rules now (None where this process may not list them)."""
    from cluster.launch.firewall import TOOLS

    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error, ValueError):
            argv = psutil.Process(pid).cmdline()
            if argv[1:4] == ["-m", "cluster.launch.firewall", "guard"] and len(argv) == 7 and argv[4] in TOOLS:
                found.append((pid, argv[4], tuple(int(p) for p in argv[5].split(",") if p)))
    listed = {tool: TOOLS[tool]().names() for tool in {tool for _, tool, _ in found}} if os.geteuid() == 0 else {}
    return [
        reach.Guardian(pid, tool, rulesets.name(pid), ports, rulesets.name(pid) in listed[tool] if tool in listed else None)
        for pid, tool, ports in found
    ]


def doctor(config_file: str | None, chief: str | None, creds, as_json: bool, run_dir: RunDir | None = None) -> int:
    found = machine_checks(config_file)
    if chief:
        found += cluster_checks(chief, creds)
    if run_dir:
        found += run_doors(run_dir)
    if as_json:
        print(json.dumps([c.as_dict() for c in found], indent=2))
    else:
        print("\n".join(c.line() for c in found))
        fails = sum(c.level == "FAIL" for c in found)
        warns = sum(c.level == "WARN" for c in found)
        print(f"pstrain doctor: {fails} FAIL, {warns} WARN, {len(found)} checks")
    return checks.exit_code(found)
