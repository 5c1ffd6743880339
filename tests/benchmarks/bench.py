"""pstrain against its peers, interleaved and repeated in one invocation on this machine.

    python -m tests.benchmarks.bench [--sizes 1m,10m,50m] [--repeats 3] [--steps 20] [--scaling] [--data] [--link 1gbit]
        [--seed 0] [--sweep 4,16,64] [--warmup-rounds 1]

Peers, same model and global batch, each at its best (tests/benchmarks/fair.py) and each printing
how it ran: pstrain sync (2 workers, 1 ps; its default steps per dispatch, and one step per dispatch),
TF2 ParameterServerStrategy asynchronous tuned (K steps per closure, one join) and one step per
closure, the TF1 SyncReplicasOptimizer recipe (2 workers), MultiWorkerMirroredStrategy (2 workers)
and one process; every step on a fresh batch. One timing definition for all (tests/benchmarks/
window.py): start-up is launch to the first applied global step; the step time is the wall time per
applied global step from the run's half to its end (pstrain's gaps between blocks included). Rounds
(tests/benchmarks/rounds.py): a discarded warm-up round, the sweep of the tuned peers' K, then
--repeats rounds, each in a seeded shuffled order; medians with ranges. Reports each peer's examples/s relative to
pstrain's, where pstrain's chief spent its start-up, and the transfer limit: the time TF's gRPC needs
to move a pstrain step's bytes on this machine. --device gpu: worker i on GPU i mod the GPUs here.
--link 1gbit | 10gbit: every task on a host of its own, ports shaped (tests/benchmarks/links.py); the
JSON adds the link's probed rate, each size's transfer limit and `pstrain plan`'s step against pstrain's.

--data: launch-to-first-step and per-step time of pstrain (1 M MLP, 2 workers) with its data (a) small
arrays, (b) --data-gb of arrays from train_data(), (c) the same as .npy files the workers read,
(d) one file per example; the data are written to --data-dir before any timing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tests.benchmarks import links
from tests.benchmarks.drawn import check_fits
from tests.benchmarks.jobs import DATA_JOBS, JOBS, parameters, write_bench_data
from tests.benchmarks.network import OPEN, add_network_flag, apply_network_flag, network_text, private_network
from tests.benchmarks.rounds import PeerFailed, add_round_args, print_size, run_size
from tests.benchmarks.window import block_ends, measure

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
PEERS = ("pstrain", "pstrain-k1", "async", "async-1step", "tf1", "mwms", "single")
NAMES = {
    "pstrain": "pstrain sync, 2 workers",
    "pstrain-open": "pstrain sync, 2 workers, no private network (TF ports open)",  # --peers only: the doors A/B
    "pstrain-k1": "pstrain sync, 2 workers, 1 step per dispatch",
    "pstrain-keras3": "pstrain sync, 2 workers, the Keras 3 twin",  # tests/benchmarks/embeddings.py --keras3
    "pstrain-allreduce": 'pstrain sync, 2 workers, dense all-reduced among the workers (train.dense = "allreduce")',
    "async": "TF2 PS async tuned, 2 workers",
    "async-1step": "TF2 PS async, 1 step per closure, 2 workers",
    "tf1": "TF1 SyncReplicasOptimizer, 2 workers",
    "mwms": "MultiWorkerMirrored, 2 workers",
    "single": "one process",
}
METHOD = "start-up: launch to the first applied global step; step: wall time per applied global step, run's half to end"
K1 = ["--steps-per-execution", "1"]  # pstrain-k1: one step per dispatch, the chief on every step's path
# pstrain's peers beside "pstrain": the flags each adds to its launch (every workload reads them here)
PSTRAIN_FLAGS = {"pstrain-k1": K1, "pstrain-open": OPEN, "pstrain-allreduce": ["--dense", "allreduce"]}
TIMEOUT_S = 900
FILES = "d one file per example (train_dataset)"
NO_READ_AHEAD = {"PSTRAIN_READ_AHEAD": "0"}


def env_for(cluster: dict, task_type: str, index: int, device: str = "cpu") -> dict:
    return {
        **os.environ,
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}}),
        "CUDA_VISIBLE_DEVICES": visible(task_type, index, device),
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",  # workers that share a GPU each take what they use
        "GRPC_FAIL_FAST": "use_caller",
        "TF_USE_LEGACY_KERAS": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONUNBUFFERED": "1",
    }


def tf1_env(cluster: dict, task_type: str, index: int, device: str) -> dict:
    """A TF1 process's environment: no TF_USE_LEGACY_KERAS, with which `import tensorflow` loads tf_keras."""
    return {k: v for k, v in env_for(cluster, task_type, index, device).items() if k != "TF_USE_LEGACY_KERAS"}


def visible(task_type: str, index: int, device: str) -> str:
    """--device gpu: worker i (and a one-process peer) on GPU i mod the GPUs here; ps, chief on none."""
    if device != "gpu" or task_type not in ("worker", "single"):
        return ""
    from cluster.launch.gpu_count import gpu_count

    return str(index % max(gpu_count(), 1))


def last_error(text: str) -> str:
    """The last line of a process's stderr that names an error (TensorFlow's status line), shortened."""
    lines = [line.strip() for line in text.splitlines() if "Error" in line and not line.startswith(("W0000", "I0000"))]
    if not lines:
        return ""
    line = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", lines[-1]).replace("tensorflow.python.framework.errors_impl.", "")
    return line[:160]


def run_group(commands: list[tuple[list[str], dict]], reporters: tuple[int, ...] = (0,), network=None) -> list[dict]:
    """Start processes (each on its host of `network`, a links.run_network; default this machine),
    wait for the last JSON line of each of `reporters` (in order), then stop and reap them all. A
    reporter without one raises PeerFailed with each process's last error line."""
    errors = [tempfile.TemporaryFile("w+") for _ in commands]
    place = network.place if network else lambda argv, env: argv
    processes: list[subprocess.Popen] = []
    try:  # each process stopped in `finally` from the moment it starts (a SIGTERM mid-start once left the first ones)
        for (argv, env), err in zip(commands, errors, strict=True):
            processes.append(subprocess.Popen(place(argv, env), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True))
        results = []
        for i in reporters:
            out, _ = processes[i].communicate(timeout=TIMEOUT_S)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if not lines:
                stop_all(processes)
                said = []
                for err in errors:
                    err.seek(0)
                    said.append(last_error(err.read()))
                said = list(dict.fromkeys(line for line in said if line))
                raise PeerFailed(f"{commands[i][0][3]} printed no result: " + (" / ".join(said) or "no error printed"))
            results.append(json.loads(lines[-1]))
        return results
    finally:
        stop_all(processes)
        for err in errors:
            err.close()


def stop_all(processes: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process still running, then reap each (SIGKILL one that outlives `grace_s`)."""
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in processes:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch_peer(
    module: str, peer: str, size: str, batch: int, steps: int, workers: int = 2, device: str = "cpu", k: int | None = None
) -> dict:
    """One run of a peer role of `module` (tests.benchmarks.peers, .embeddings, .recsys) as its processes,
    `k` its steps per closure or call (None: fair.PER_DISPATCH): the result of its reporter (every
    worker's for mwms, in "reports"), measured by window.measure."""
    with links.run_network(2 + workers) as net:  # --link: a shaped host per task, made before the launch
        return launch_on(net, module, peer, size, batch, steps, workers, device, k)


def launch_on(
    net, module: str, peer: str, size: str, batch: int, steps: int, workers: int, device: str, k: int | None = None
) -> dict:
    """launch_peer's run on `net` (links.run_network): its tasks at net's addresses, on net's hosts."""
    me = [PY, "-m", module, peer, size, str(batch), str(steps), *([str(k)] if k else [])]
    t_launch = time.time()
    if peer in ("async", "async-1step", "transfer", "transfer-looped"):
        addresses = net.addresses(2 + workers)
        cluster = {"chief": addresses[:1], "ps": addresses[1:2], "worker": addresses[2:]}
        tasks = [("ps", 0)] + [("worker", i) for i in range(workers)]
        servers = [([PY, "-m", "worker"], env_for(cluster, t, i, device)) for t, i in tasks]
        reports = run_group([(me, env_for(cluster, "chief", 0, device)), *servers], network=net)
    elif peer == "tf1":
        addresses = net.addresses(1 + workers)
        cluster = {"ps": addresses[:1], "worker": addresses[1:]}
        group = [(me, tf1_env(cluster, "worker", i, device)) for i in range(workers)]
        group.append((me, tf1_env(cluster, "ps", 0, device)))
        reports = run_group(group, network=net)
    elif peer == "mwms":
        cluster = {"worker": net.addresses(workers)}
        reports = run_group([(me, env_for(cluster, "worker", i, device)) for i in range(workers)], tuple(range(workers)), net)
    else:
        reports = run_group([(me, {**env_for({}, "single", 0, device), "TF_CONFIG": ""})])
    result = {**reports[0], **measure(reports[0]["samples"], steps, t_launch), "t_launch": t_launch}
    if len(reports) > 1:
        result["reports"] = [{k: v for k, v in r.items() if k != "samples"} for r in reports]
    return result


def peer_pstrain(
    size: str,
    batch: int,
    steps: int,
    workers: int = 2,
    ps: int = 1,
    job: str = "",
    env: dict | None = None,
    extra: list[str] | None = None,
    device: str = "cpu",
) -> dict:
    """pstrain launched as a user would (`job`: default the MLP of `size`); samples are its blocks'
    ends in metrics.jsonl (the gaps between blocks count), measured like every peer's by
    window.measure; the chief's start-up phases from its log."""
    tmp = tempfile.mkdtemp(prefix="pstrain-bench-")  # kept when pstrain fails, for its logs
    run_dir = Path(tmp) / "run"
    config = Path(tmp) / "device.toml"  # cpu: no worker on a GPU; gpu: "auto" (shared round-robin)
    gpus = '"auto"' if device == "gpu" else str([-1] * workers)
    config.write_text(f"[cluster]\nworker_gpus = {gpus}\n")
    argv = [PY, "-m", "cluster.cli", "launch", "--config", str(config), "--job", job or JOBS[size], "--steps", str(steps)]
    argv += ["--checkpoint-every", "0", "--global-batch-size", str(batch), "--run-dir", str(run_dir)]
    if not private_network() and "--no-private-network" not in (extra or []):
        argv += OPEN
    with links.run_network(1 + ps + workers) as net:  # --link: launch on the chief's host, a node per ps/worker
        t_launch = time.time()
        options = {"cwd": ROOT, "capture_output": True, "text": True, "timeout": TIMEOUT_S, "env": {**os.environ, **(env or {})}}
        run = net.run_pstrain(argv + (extra or []), config, workers, ps, **options)
    if run.returncode:
        raise RuntimeError(f"pstrain failed (logs kept in {run_dir / 'logs'}): {run.stdout[-2000:]}{run.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "step" in r and "event" not in r]
    done = next(r for r in records if r.get("event") == "done")
    described = json.loads((run_dir / "cluster.json").read_text())
    per_execution = described["train"]["steps_per_execution"]
    samples = block_ends(records)
    window = measure(samples, steps, t_launch)
    measured = [r for r in steps_ if window["window"][0] < r["step"] <= window["window"][1]] or steps_
    result = {
        **window,
        "t_launch": t_launch,
        "samples": samples,
        "setup": f"{per_execution} steps per dispatch (a block), {job_data(job or JOBS[size])}; "
        + network_text(described["private_network"])
        + ('; train.dense = "allreduce"' if "allreduce" in (extra or []) else ""),
        "private_network": described["private_network"],  # as the run recorded it (cluster.json)
        "startup_phases": startup_phases((run_dir / "logs" / "chief-0.log").read_text()),
        "timing": {k: statistics.median(r["timing"][k] for r in measured) for k in measured[0]["timing"]},
        "chief_peak_rss_mib": done.get("peak_rss_mib"),  # the chief's high-water mark, final checkpoint and export included
    }
    if "read_ahead" in measured[-1]:  # the share of applied gradients whose examples were read ahead
        counted = [r for r in measured if "read_ahead" in r]
        result["read_ahead"] = sum(r["read_ahead"] for r in counted) / (sum(r["aggregated"] for r in measured) or 1)
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def job_data(job: str) -> str:
    """Where a benchmark job's examples come from: its class's `bench_data`."""
    module, _, name = job.partition(":")
    return getattr(importlib.import_module(module), name).bench_data


def startup_phases(chief_log: str) -> dict[str, float]:
    """The chief's "start-up: phase 1.23s, ..." line as {phase: seconds}."""
    line = next((line for line in chief_log.splitlines() if "pstrain.chief start-up: " in line), "")
    pairs = [part.rsplit(" ", 1) for part in line.split("start-up: ", 1)[-1].split(", ") if part.endswith("s")]
    return {phase: float(seconds[:-1]) for phase, seconds in pairs}


def startup_line(runs: list[dict]) -> str:
    """pstrain's launch to first step, and the chief's share of it by phase (medians)."""
    phases = {k: statistics.median(r["startup_phases"].get(k, 0.0) for r in runs) for k in runs[0]["startup_phases"]}
    return f"pstrain launch to first step {med(runs, 'startup_s'):.1f} s; the chief: " + ", ".join(
        f"{k} {v:.1f} s" for k, v in phases.items()
    )


def run_peer(peer: str, size: str, batch: int, steps: int, device: str = "cpu", k: int | None = None) -> dict:
    if peer.startswith("pstrain"):
        return peer_pstrain(size, batch, steps, extra=PSTRAIN_FLAGS.get(peer), device=device)
    return launch_peer("tests.benchmarks.peers", peer, size, batch, steps, device=device, k=k)


def new_results(batch: int, steps: int, private_network: bool) -> dict:
    """An invocation's JSON before its runs (each size's are added by rounds.run_size)."""
    return {"machine": machine(), "global_batch": batch, "steps": steps, "private_network": private_network, "runs": {}}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{psutil.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB, CPU only, {links.name()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1m,10m,50m", help="comma-separated; empty for --scaling alone")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--scaling", action="store_true", help="also pstrain with 1, 2, 4, 8 workers and 1, 2 ps (10m)")
    parser.add_argument("--data", action="store_true", help="also pstrain fed from (a)-(d): where the data lives")
    parser.add_argument("--data-gb", type=float, default=2.0, help="size of the large set for --data (b), (c)")
    parser.add_argument("--data-files", type=int, default=20000, help="example files for --data (d)")
    parser.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "pstrain-bench-data"), help="kept for reuse")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="gpu: worker i on GPU i mod the GPUs here")
    parser.add_argument("--out", default="", help="write all results as JSON here")
    add_network_flag(parser)
    links.add_flags(parser)
    add_round_args(parser)
    args = parser.parse_args()
    if why := check_fits(args.steps, args.global_batch_size):
        parser.error(why)
    if why := links.use(args.link, args.plan_fit):  # refused in one line where namespaces cannot be made
        print(why, file=sys.stderr)
        return 2
    in_namespace = apply_network_flag(args)
    sizes, peers, batch = [s for s in args.sizes.split(",") if s], args.peers.split(","), args.global_batch_size
    results = new_results(batch, args.steps, in_namespace)
    head = f"# {results['machine']}; global batch {batch}; {args.steps} steps per run; {network_text(in_namespace)}"
    print(f"{head}; {METHOD}", flush=True)
    for size in sizes:
        rounds = run_size(
            results,
            size,
            [*peers, *PROBES],
            lambda peer, k, size=size: run_peer(peer, size, batch, args.steps, args.device, k),
            args,
        )
        print_size(table(size, rounds["runs"], batch, rounds["failed"]), rounds)
    links.records(args, JOBS, results, batch)  # --link: the transfer limit and plan's step, per size
    if args.scaling:
        results["scaling"] = scaling(batch, args.steps)
        print(scaling_table(results["scaling"], batch), flush=True)
    if args.data:
        results["data"] = data_runs(args.data_dir, args.data_gb, args.data_files, args.repeats, batch, args.steps)
        print(data_table(results["data"], args.data_gb, args.data_files), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


PROBES = ("transfer", "transfer-looped")  # the same bytes without compute: a closure per step, and 16 per closure


def limit_text(runs: dict[str, list[dict]], base: float) -> str:
    """The transfer limit both ways (a join every step; 16 steps per closure, one join) and pstrain's step over each."""
    bytes_ = runs["transfer"][0]["bytes_per_step"]
    limits = {p: med(runs[p], "step_s") for p in PROBES if runs.get(p)}
    parts = [f"{p} {limit * 1000:.1f} ms (step = {base / limit:.2f}×)" for p, limit in limits.items()]
    return f"transfer limit (the same {bytes_ / 2**20:.2f} MiB over TF gRPC): " + ", ".join(parts)


def spread(runs: list[dict], key: str, scale: float = 1.0) -> str:
    """The median of the rounds, and their range where there are several."""
    values = [r[key] * scale for r in runs]
    text = f"{statistics.median(values):.1f}"
    return text + (f" ({min(values):.1f}–{max(values):.1f})" if len(values) > 1 else "")


def peer_rows(runs: dict[str, list[dict]], batch: int, failed: dict[str, str] | None = None) -> list[str]:
    """The table of peers: medians over the rounds (their range), pstrain's examples/s over each's; a
    peer in `failed` gets a row that says why it has no figures."""
    base = med(runs["pstrain"], "step_s") if runs.get("pstrain") else None
    lines = [
        "| peer | ms/step (range) | examples/s | pstrain ÷ peer (examples/s) | start-up s (range) |",
        "|---|---|---|---|---|",
    ]
    for peer, label in NAMES.items():
        if peer in (failed or {}):
            lines.append(f"| {label} | did not run: {failed[peer].split(': ', 1)[1]} | – | – | – |")
        if not runs.get(peer):
            continue
        step = med(runs[peer], "step_s")
        ratio = f"{step / base:.2f}×" if base else "–"
        cells = [label, spread(runs[peer], "step_s", 1000), f"{batch / step:,.0f}", ratio, spread(runs[peer], "startup_s")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def table(size: str, runs: dict[str, list[dict]], batch: int, failed: dict[str, str] | None = None) -> str:
    base = med(runs["pstrain"], "step_s") if runs.get("pstrain") else 0.0
    lines = [f"\n{size} ({parameters(size) / 1e6:.1f} M parameters)", *peer_rows(runs, batch, failed)]
    if not runs.get("pstrain"):
        return "\n".join(lines)
    timing = {k: statistics.median(r["timing"][k] for r in runs["pstrain"]) for k in runs["pstrain"][0]["timing"]}
    lines.append(
        f"\npstrain step {base * 1000:.1f} ms = the chief's dispatch {timing['dispatch'] * 1000:.1f} + steps on workers and ps "
        f"{timing['steps'] * 1000:.1f} (shares of a block); {limit_text(runs, base)}"
    )
    lines.append(startup_line(runs["pstrain"]))
    return "\n".join(lines)


def data_runs(directory: str, gigabytes: float, files: int, repeats: int, batch: int, steps: int) -> dict[str, list[dict]]:
    write_bench_data(directory, gigabytes, files)
    # (e): (d) with read-ahead turned off, the peer that shows what reading the next step ahead buys.
    cases = {name: (job, {}) for name, job in DATA_JOBS.items()}
    cases["e (d) without read-ahead"] = (DATA_JOBS[FILES], NO_READ_AHEAD)
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for repeat in range(repeats):  # interleaved: every set-up once per round
        for name, (job, env) in cases.items():
            r = peer_pstrain("1m", batch, steps, job=job, env={"PSTRAIN_BENCH_DATA": directory, **env})
            runs[name].append(r)
            what = f"start-up {r['startup_s']:.1f} s, {r['step_s'] * 1000:.1f} ms/step"
            what += f", {r['read_ahead']:.0%} read ahead" if "read_ahead" in r else ""
            print(f"  data round {repeat + 1} {name}: {what}", flush=True)
    return runs


def data_table(runs: dict[str, list[dict]], gigabytes: float, files: int) -> str:
    base = next(iter(runs.values()))
    start_a, step_a = med(base, "startup_s"), med(base, "step_s")
    lines = [
        f"\nwhere the data lives (1 M MLP, 2 workers; large set {gigabytes:g} GB, {files:,} example files)",
        "| data | launch to first step s | ÷ (a) | ms/step | ÷ (a) | read ahead |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        start, step = med(r, "startup_s"), med(r, "step_s")
        ahead = f"{med(r, 'read_ahead'):.0%}" if "read_ahead" in r[0] else "–"
        ratios = f"{start:.1f} | {start / start_a:.2f}× | {step * 1000:.1f} | {step / step_a:.2f}× | {ahead}"
        lines.append(f"| ({name[0]}) {name[2:]} | {ratios} |")
    return "\n".join(lines)


def scaling(batch: int, steps: int) -> list[dict]:
    rows = []
    for ps in (1, 2):
        for workers in (1, 2, 4, 8):
            r = peer_pstrain("10m", batch, steps, workers=workers, ps=ps)
            rows.append({"ps": ps, "workers": workers, **r})
            print(f"  scaling ps={ps} workers={workers}: {r['step_s'] * 1000:.1f} ms/step", flush=True)
    return rows


def scaling_table(rows: list[dict], batch: int) -> str:
    lines = ["\nscaling (10m, pstrain sync)", "| ps | workers | ms/step | examples/s |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ps']} | {r['workers']} | {r['step_s'] * 1000:.1f} | {batch / r['step_s']:,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    from tests.benchmarks.command import end_on_sigterm

    end_on_sigterm()
    raise SystemExit(main())
