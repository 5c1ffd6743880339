"""Links shaped like real networks for the benchmarks: `--link loopback | 1gbit | 10gbit`.

loopback (the default): every task on this machine's loopback, as before. A shaped link: every task
of a run (chief, each ps, each worker; each peer's tasks alike) on a host of its own, a network
namespace joined to a bridge by a veth pair (tests/netns.py's `lan`), both ends of every veth shaped
by `tc ... tbf` at the link's rate, so each host has a full-duplex port of that rate, as on a switch.
The hosts of a run are made before its launch and removed after its processes are stopped and
reaped: on a normal end, an error, Ctrl-C or SIGTERM; those of a SIGKILLed invocation are removed
when the next --link invocation starts (`sweep`). Where namespaces cannot be made, `--link` is
refused in one line.

The benchmarks' hooks (tests/benchmarks/bench.py, embeddings.py): `add_flags` and `use(link)` once
per invocation, `records` after its runs; per run `run_network(hosts)`: `addresses(n)` for a TF
cluster, `place(argv, env)` to start a task on its host, `run_pstrain(...)` to launch pstrain with a
node per host (docs/two-machines.md).

    python -m tests.benchmarks.links probe RATE [--mib N]   # a transfer between two shaped hosts
    python -m tests.benchmarks.links gather RATE [--mib N]  # a 2-worker gather and all-reduce of N MiB there
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

LINKS = {"loopback": None, "1gbit": 1e9 / 8, "10gbit": 10e9 / 8}  # bytes per second of each host's port
PREFIX = "pstl"  # the namespaces' names: pstl<label>-<pid>, pstlsw-<pid> (the bridge's)
SUBNET = "10.253.0"
BURST_S = 0.001  # tbf's bucket: a millisecond at the rate...
MIN_BURST = 128 << 10  # ...and at least two 64 KiB GSO segments, or tbf drops what veth hands it whole
LATENCY = "50ms"  # queue before tbf drops: TCP then paces itself instead of losing packets
PORTS = {"chief": 2220, "ps": 2221, "worker": 2222, "control": 2229}
PSTRAIN = [sys.executable, "-m", "cluster.cli"]
ROOT = Path(__file__).resolve().parents[2]


class LinkError(Exception):
    """`--link` cannot be used here or as given; the message is one line naming the flag."""


def parse_link(text: str) -> float | None:
    """'loopback' -> None; '1gbit' / '10gbit' -> the port's rate in bytes per second. Pure."""
    if text not in LINKS:
        raise LinkError(f"--link: expected one of {', '.join(LINKS)}, got {text!r}")
    return LINKS[text]


def tbf(rate: float) -> list[str]:
    """The `tc qdisc add dev D root` tail shaping a device to `rate` bytes/s. Pure."""
    burst = max(int(rate * BURST_S), MIN_BURST)
    return ["tbf", "rate", f"{round(rate * 8)}bit", "burst", str(burst), "latency", LATENCY]


def allreduce_limit(table_bytes: float, dense_bytes: float, workers: int, rate: float) -> dict:
    """The seconds a hybrid step's bytes (train.dense = "allreduce") need through the busiest port: a
    worker's, its table pulls and pushes (`table_bytes`, both ways: the step's pull and push do not
    overlap) and the ring exchange of the dense gradients (2 workers: an all-reduce; more: a gather),
    N-1 of `dense_bytes` each way at once (a ring sends while it receives: `python -m
    tests.benchmarks.links gather 1gbit --mib 40` moves 40 MiB each way in 1.2-1.45x one way's time,
    not 2x), so counted once; or the ps's, every worker's table bytes
    (the once-per-block write-back left out). `pstrain plan` counts the same bytes, after the worker's
    compute (cluster/forecast/model.py `predict_allreduce`). Pure."""
    worker = table_bytes + (workers - 1) * dense_bytes
    busiest = max(worker, table_bytes * workers)
    return {"busiest_port_bytes": busiest, "rate_bytes_per_s": rate, "limit_s": busiest / rate}


def transfer_limit(pull_bytes: float, push_bytes: float, workers: int, ps: int, rate: float) -> dict:
    """The seconds a step's bytes need through the busiest port, for the ps design: each worker pulls
    `pull_bytes` and pushes `push_bytes` per step, split evenly over `ps` servers. A synchronous step
    pulls, computes, then pushes: the two directions do not overlap (measured: pstrain's 1 M MLP on
    1gbit steps in 140 ms, 1.04x the sum, 2.1x the larger direction), so a port's bytes both ways count,
    as `pstrain plan`'s ps network does. Pure."""
    busiest = max((pull_bytes + push_bytes) * workers / ps, pull_bytes + push_bytes)
    return {"busiest_port_bytes": busiest, "rate_bytes_per_s": rate, "limit_s": busiest / rate}


def plan_error(predicted_s: float, measured_s: float) -> dict:
    """`pstrain plan`'s step against the measured one: the relative error and the 25 % target. Pure."""
    error = predicted_s / measured_s - 1
    return {"predicted_s": predicted_s, "measured_s": measured_s, "error": error, "within_25pct": abs(error) <= 0.25}


def refusal() -> str:
    """'' where shaped hosts can be made here, else the one-line reason."""
    from tests.netns import can_create_namespaces

    why = can_create_namespaces()
    if not why:
        probe = subprocess.run(["tc", "qdisc", "help"], capture_output=True, text=True, timeout=30)
        why = "" if "Usage" in probe.stdout + probe.stderr else "the tc command (iproute2) is not installed"
    return f"--link: cannot make network-namespace hosts here ({why}); run with --link loopback" if why else ""


_selected: str = "loopback"  # the invocation's link (`use`)
RTT_S = 1e-4  # a round trip between two hosts on the bridge, for plan's two per step (as plan_check's)


def use(link: str, plan_fit: str = "") -> str:
    """Make `link` the invocation's: every later run_network uses it. '' on success, else the one-line
    refusal (unknown, shaped hosts cannot be made here, or a --plan-fit that is malformed or without a
    shaped link); the benchmark prints it and exits 2."""
    global _selected
    from cluster.errors import ConfigError
    from cluster.forecast.report import parse_runs

    try:
        rate = parse_link(link)
        if plan_fit:
            parse_runs(plan_fit)
    except (LinkError, ConfigError) as e:
        return str(e).replace("--measure:", "--plan-fit:")
    if plan_fit and rate is None:
        return "--plan-fit: plan's step is held against shaped runs only; give --link 1gbit or 10gbit"
    if rate is not None and (why := refusal()):
        return why
    if rate is not None:
        sweep()  # SIGTERM runs the finally blocks that remove the hosts (tests/benchmarks/command.py)
    _selected = link
    return ""


def stale(names: list[str], pids: list[int]) -> list[str]:
    """The namespaces among `names` that a --link invocation made (pstl*-<pid mod 100000>, as
    tests.netns.lan names them) and whose maker runs no more: no pid of `pids` (those running) has
    that suffix. Left by a SIGKILLed benchmark; a live one's are never among them. Pure."""
    suffixes = {str(pid % 100000) for pid in pids}
    out = []
    for namespace in names:
        head, _, suffix = namespace.rpartition("-")
        if head.startswith(PREFIX) and suffix.isdigit() and suffix not in suffixes:
            out.append(namespace)
    return out


def sweep() -> None:
    """Remove the hosts a SIGKILLed --link invocation left (its namespaces and /etc/netns folders)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    for namespace in stale(names, psutil.pids()):
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)


def name() -> str:
    """The invocation's link, as the benchmarks' machine line says it."""
    return "loopback" if LINKS[_selected] is None else f"a host per task, {_selected} ports (tc tbf)"


def add_flags(parser: argparse.ArgumentParser) -> None:
    shaped = f"{' | '.join(LINKS)}: a network-namespace host per task, ports shaped by tc tbf"
    parser.add_argument("--link", default="loopback", help=shaped)
    fit_help = "--link: fit pstrain plan's costs on these loopback runs (e.g. 1x1,2x1,1x2,2x2)"
    parser.add_argument("--plan-fit", default="", help=fit_help)


def records(args, jobs: dict[str, str], results: dict, batch: int, workers: int = 2) -> None:
    """After the runs of a shaped invocation: results["link"] (the link and its probe) and
    results["links"][size] (`record`, pstrain's median step from results["runs"][size])."""
    if LINKS[_selected] is None:
        return
    results["link"] = describe()
    for size, runs in results["runs"].items():
        hybrid_ran = bool(runs.get("pstrain-allreduce"))
        costs, hybrid = fitted(jobs[size], batch, args.plan_fit, allreduce=hybrid_ran) if args.plan_fit else (None, None)
        for peer, dense in (("pstrain", "ps"), ("pstrain-allreduce", "allreduce")):
            if dense == "allreduce" and not runs.get(peer):
                continue
            steps = sorted(r["step_s"] for r in runs.get(peer, []))
            step = steps[len(steps) // 2] if steps else None
            key = size if dense == "ps" else f"{size}-allreduce"
            results.setdefault("links", {})[key] = record(jobs[size], batch, workers, 1, step, costs, dense, hybrid=hybrid)
            print(f"{size} on {_selected} ({peer}): {summary(results['links'][key])}", flush=True)


def summary(entry: dict) -> str:
    limit, plan = entry["transfer_limit"], entry["plan"]
    moved = f"{limit['busiest_port_bytes'] / 2**20:.2f} MiB through the busiest port"
    text = f"transfer limit {limit['limit_s'] * 1000:.1f} ms ({moved})"
    if "measured_s" in plan:
        text += f"; pstrain {plan['measured_s'] * 1000:.1f} ms = {limit['pstrain_step_over_limit']:.2f}× the limit"
        text += f"; plan ({plan['model']}) {plan['predicted_s'] * 1000:.1f} ms, {plan['error']:+.0%}"
    return text


def describe(probe_mib: int = 128) -> dict:
    """The invocation's link for the JSON: its name, rate and tbf, and a probe transfer's measured rate."""
    rate = LINKS[_selected]
    if rate is None:
        return {"name": "loopback"}
    return {"name": _selected, **probe(rate, probe_mib << 20)}


def record(
    job: str,
    batch: int,
    workers: int,
    ps: int,
    pstrain_step_s: float | None,
    costs=None,
    dense: str = "ps",
    block: int = 64,
    hybrid=None,
) -> dict:
    """For a shaped invocation's workload `job` (a pstrain job spec) run with train.dense = `dense` (and
    K = `block`): the transfer limit (`transfer_limit`, or `allreduce_limit`) and `pstrain plan`'s step
    for the shaped run against pstrain's measured one. `costs`: plan's fitted costs
    (cluster.forecast.model.fit), and `hybrid` its hybrid worker's (`fit_allreduce`); None: plan's
    network terms alone (every CPU cost zero), which bind where the link is the bottleneck."""
    from cluster.forecast.model import Costs, Scenario, predict, predict_allreduce, pstrain_placement
    from cluster.forecast.variables import job_bytes

    rate = LINKS[_selected]
    found = job_bytes(job, batch // workers)
    variables = found.variables
    pull, push = sum(v.pull_bytes for v in variables), sum(v.push_bytes for v in variables)
    scenario = Scenario(workers, ps, batch, rate, RTT_S, costs.cores if costs else None)
    nothing = Costs(**{f.name: 0.0 for f in dataclasses.fields(Costs)})
    placement = pstrain_placement(variables, ps)
    if dense == "allreduce":
        prediction = predict_allreduce(costs or nothing, variables, placement, scenario, found.slots, block, hybrid)
        tables = sum(v.pull_bytes + v.push_bytes for v in variables if v.row_sparse)
        limit = allreduce_limit(tables, sum(v.push_bytes for v in variables if not v.row_sparse), workers, rate)
    else:
        prediction = predict(costs or nothing, variables, placement, scenario)
        limit = transfer_limit(pull, push, workers, ps, rate)
    model = "fitted costs, the measured runs' cores" if costs else "network term only (no fitted costs)"
    if costs and dense == "allreduce":
        model += ", the hybrid worker's from its own runs" if hybrid else ", the hybrid worker's assumed"
    plan = {
        "model": model,
        "costs": {
            **({"ps": dataclasses.asdict(costs)} if costs else {}),
            **({"allreduce": dataclasses.asdict(hybrid)} if hybrid and dense == "allreduce" else {}),
        },
        "binding": prediction.binding,
        "loads_s": prediction.loads,
    }
    if pstrain_step_s:
        plan |= plan_error(prediction.step_s, pstrain_step_s)
    if pstrain_step_s:
        limit["pstrain_step_over_limit"] = pstrain_step_s / limit["limit_s"]
    per_worker = {"pull_bytes_per_worker": pull, "push_bytes_per_worker": push}
    return {"link": _selected, "dense": dense, **per_worker, "transfer_limit": limit, "plan": plan}


def fitted(job: str, batch: int, runs: str, steps: int = 400, allreduce: bool = False) -> tuple:
    """`pstrain plan`'s costs for `job`, fitted on its measured loopback runs (`runs`: '1x1,2x1,1x2,2x2')
    of `steps` each (`pstrain plan --measure-steps`'s default: a steady window after the first third),
    and with `allreduce` its hybrid worker's, on plan's runs with train.dense = "allreduce" (else None)."""
    from cluster.forecast.command import DEFAULT_ALLREDUCE_RUNS
    from cluster.forecast.measure import measure
    from cluster.forecast.model import fit, fit_allreduce
    from cluster.forecast.report import parse_runs

    observations = [measure(job, w, p, batch, steps, steps // 3) for w, p in parse_runs(runs)]
    if allreduce:
        hybrid_runs = parse_runs(DEFAULT_ALLREDUCE_RUNS, ps_counts=1)
        observations += [measure(job, w, p, batch, steps, steps // 3, dense="allreduce") for w, p in hybrid_runs]
    costs = fit(observations)
    return costs, fit_allreduce(costs, observations) if allreduce else None


def free_ports(n: int) -> list[str]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Loopback:
    """Every task on this machine's loopback, on free ports."""

    rate = None

    def addresses(self, n: int) -> list[str]:
        return free_ports(n)

    def place(self, argv: list[str], env: dict) -> list[str]:
        return argv

    def run_pstrain(self, argv: list[str], config: Path, workers: int, ps: int, **run) -> subprocess.CompletedProcess:
        return subprocess.run([*argv, "--workers", str(workers), "--ps", str(ps)], **run)


class Hosts:
    """A run's shaped hosts (tests.netns.Host): task i of a TF cluster on host i."""

    def __init__(self, hosts: list, rate: float):
        self.hosts, self.rate = hosts, rate

    def addresses(self, n: int) -> list[str]:
        if n > len(self.hosts):
            raise ValueError(f"links: {n} tasks on {len(self.hosts)} hosts; give run_network more")
        return [f"{host.address}:{PORTS['worker']}" for host in self.hosts[:n]]

    def place(self, argv: list[str], env: dict) -> list[str]:
        """`argv` on the host of the task its TF_CONFIG names (no task: on the first host)."""
        config = json.loads(env.get("TF_CONFIG") or "{}")
        task = config.get("task")
        address = config["cluster"][task["type"]][task["index"]] if task else self.hosts[0].address
        host = next(h for h in self.hosts if address.split(":")[0] == h.address)
        return host.command(argv)

    def run_pstrain(self, argv: list[str], config: Path, workers: int, ps: int, **run) -> subprocess.CompletedProcess:
        """`pstrain launch` on host 0 (the chief), `pstrain node` on each other host (a ps or a worker
        each, docs/two-machines.md); the nodes end with the run, or are stopped and reaped."""
        if 1 + ps + workers > len(self.hosts):
            raise ValueError(f"links: pstrain needs {1 + ps + workers} hosts, the run has {len(self.hosts)}")
        chief, servers = self.hosts[0], self.hosts[1 : 1 + ps + workers]
        token = config.parent / "token"
        token.write_text(os.urandom(16).hex() + "\n")
        quoted = lambda hosts, role: ", ".join(f'"{h.address}:{PORTS[role]}"' for h in hosts)  # noqa: E731
        config.write_text(
            config.read_text()
            + f'chief = "{chief.address}:{PORTS["chief"]}"\ncontrol = "{chief.address}:{PORTS["control"]}"\n'
            + f'ps = [{quoted(servers[:ps], "ps")}]\nworkers = [{quoted(servers[ps:], "worker")}]\ntoken_file = "{token}"\n'
        )
        control = f"{chief.address}:{PORTS['control']}"
        node = [*PSTRAIN, "node", "--chief", control, "--token-file", str(token), "--allow-open-ports"]
        logs = config.parent / "nodes"
        logs.mkdir(exist_ok=True)
        nodes = [
            subprocess.Popen(host.command([*node, "--log-dir", str(logs / str(i))]), cwd=ROOT, env=run.get("env"), **_quiet())
            for i, host in enumerate(servers)
        ]
        try:
            return subprocess.run(chief.command([*argv, "--allow-open-ports"]), **run)
        finally:
            for p in nodes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=60)  # a node ends with the run it served
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()


def _quiet() -> dict:
    return {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}


@contextlib.contextmanager
def run_network(hosts: int) -> Iterator[Loopback | Hosts]:
    """One run's network: loopback, or `hosts` shaped hosts at the selected rate, removed on exit."""
    rate = LINKS[_selected]
    if rate is None:
        yield Loopback()
        return
    with shaped_hosts(hosts, rate) as made:
        yield Hosts(made, rate)


@contextlib.contextmanager
def shaped_hosts(count: int, rate: float) -> Iterator[list]:
    """`count` hosts on one bridge, each port shaped to `rate` bytes/s both ways (tests.netns.lan)."""
    from tests.netns import lan

    members = {f"h{i}": [f"h{i}"] for i in range(count)}
    with lan(PREFIX, members, SUBNET, shaping=tbf(rate)) as hosts:
        yield list(hosts.values())


# --- the probe: a transfer between two shaped hosts, timed by the receiver --------------------------


def receive(port: int) -> None:
    """Accept one connection, read to its end; print {"bytes", "seconds"} from first byte to last."""
    with socket.create_server(("0.0.0.0", port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        with conn:
            total, first = 0, None
            while chunk := conn.recv(1 << 20):
                first = first or time.perf_counter()
                total += len(chunk)
            last = time.perf_counter()
    print(json.dumps({"bytes": total, "seconds": last - (first or last)}), flush=True)


def send(address: str, nbytes: int) -> None:
    host, port = address.rsplit(":", 1)
    block = b"\0" * (1 << 20)
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        left = nbytes
        while left > 0:
            conn.sendall(block[: min(left, len(block))])
            left -= len(block)


def measure_rate(sender, receiver, nbytes: int) -> dict:
    """Move `nbytes` from host `sender` to host `receiver` (tests.netns.Host); the receiver's
    {"bytes", "seconds", "bytes_per_s"}. Both processes are reaped on every path."""
    me = [sys.executable, "-m", "tests.benchmarks.links"]
    rx = subprocess.Popen(receiver.command([*me, "receive", "5001"]), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "listening"
        subprocess.run(sender.command([*me, "send", f"{receiver.address}:5001", str(nbytes)]), cwd=ROOT, check=True, timeout=300)
        out, _ = rx.communicate(timeout=60)
        result = json.loads(out.strip().splitlines()[-1])
        return {**result, "bytes_per_s": result["bytes"] / result["seconds"]}
    finally:
        if rx.poll() is None:
            rx.kill()
        rx.wait()


def probe(rate: float, nbytes: int) -> dict:
    """Two fresh shaped hosts and one transfer between them: what a --link run's ports really carry."""
    with shaped_hosts(2, rate) as (a, b):
        return {**measure_rate(a, b, nbytes), "rate_bytes_per_s": rate, "tbf": tbf(rate)}


# --- the gather probe: the hybrid's exchange alone, between two shaped hosts ----------------------


def collective(nbytes: int, repeats: int) -> None:
    """A TF task of a 2-worker cluster (TF_CONFIG): time a CollectiveGatherV2 (the hybrid's exchange
    among 3 or more workers, worker/replica/allreduce.py) and a CollectiveReduceV2 (the hybrid's between
    2, and MultiWorkerMirrored's all-reduce) of
    `nbytes` of float32, `repeats` each after one untimed; print {"gather_s", "reduce_s"}, the mean
    seconds of one. MultiWorkerMirroredStrategy sets up the workers' collective executor."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.distribute.MultiWorkerMirroredStrategy()
    x = tf.random.normal([nbytes // 4])
    # A lost peer fails the op at once; a hung one after 120 s.
    group = {"group_size": 2, "ordering_token": [], "timeout_seconds": 120.0}
    raw, add = tf.raw_ops, {"merge_op": "Add", "final_op": "Id"}
    ops = {
        "gather_s": lambda x: raw.CollectiveGatherV2(input=x[tf.newaxis], group_key=100, instance_key=1, **group),
        "reduce_s": lambda x: raw.CollectiveReduceV2(input=x, group_key=101, instance_key=2, **group, **add),
    }
    seconds = {}
    for name, fn in ops.items():
        op = tf.function(fn)
        op(x).numpy()
        start = time.perf_counter()
        for _ in range(repeats):
            y = op(x)
        y.numpy()
        seconds[name] = (time.perf_counter() - start) / repeats
    print(json.dumps(seconds), flush=True)


def gather_probe(rate: float, nbytes: int, repeats: int = 5) -> dict:
    """Two fresh shaped hosts, a TF task on each (`collective`): the seconds of a gather and of an
    all-reduce of `nbytes` per worker, worker 0's, beside one way's time at the rate (each moves
    `nbytes` each way between 2 workers: a gather's whole rows, a ring all-reduce's two halves). Both
    processes are reaped on every path (bench.run_group)."""
    from tests.benchmarks.bench import run_group  # bench imports this module

    with shaped_hosts(2, rate) as hosts:
        cluster = {"worker": [f"{h.address}:{PORTS['worker']}" for h in hosts]}
        argv = [sys.executable, "-m", "tests.benchmarks.links", "collective", str(nbytes), str(repeats)]
        tasks = [json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}) for i in range(2)]
        (result,) = run_group([(argv, {**os.environ, "TF_CONFIG": task}) for task in tasks], network=Hosts(hosts, rate))
    return {"bytes_each_way": nbytes, "one_way_s": nbytes / rate, "rate_bytes_per_s": rate, **result}


def main(args: list[str]) -> int:
    if args[:1] == ["receive"]:
        receive(int(args[1]))
        return 0
    if args[:1] == ["send"]:
        send(args[1], int(args[2]))
        return 0
    if args[:1] == ["collective"]:
        collective(int(args[1]), int(args[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["probe", "gather"])
    parser.add_argument("link", choices=[k for k in LINKS if LINKS[k]])
    parser.add_argument("--mib", type=int, default=256)
    options = parser.parse_args(args)
    if why := refusal():
        print(why, file=sys.stderr)
        return 2
    measure = probe if options.command == "probe" else gather_probe
    print(json.dumps(measure(LINKS[options.link], options.mib << 20)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
