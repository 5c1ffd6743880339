"""`python -m cluster.doctor.gpu_check CLUSTER_RUN STANDALONE_RUN` (deploy/gpu_check.sh runs it):
where TensorFlow placed each worker's compute ops, and pstrain's throughput against one process.

The cluster run must have been started with PSTRAIN_LOG_DEVICE_PLACEMENT=1: the chief then turns on
TensorFlow's device-placement log, which its workers inherit, so each worker's log names the device
of every op of the functions it runs (`.../Conv2D: (Conv2D): /job:worker/replica:0/task:0/device:GPU:0`).
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import Counter

from cluster import errors
from cluster.errors import PstrainError
from cluster.rundir import RunDir

COMPUTE_OPS = ("Conv2D", "MatMul", "_MklMatMul", "_FusedMatMul", "_MklFusedMatMul", "BiasAdd", "Conv2DBackpropFilter")
PLACEMENT = re.compile(r"^\S+: \((\w+)\): (/job:worker/replica:\d+/task:(\d+)/device:(\w+):\d+)$", re.M)


def placements(log_text: str) -> dict[int, Counter]:
    """worker index -> Counter of the devices its compute ops were placed on (from a placement log)."""
    out: dict[int, Counter] = {}
    for op, device, task, _kind in PLACEMENT.findall(log_text):
        if op in COMPUTE_OPS:
            out.setdefault(int(task), Counter())[device] += 1
    return out


def examples_per_second(run_dir: RunDir, skip: int = 3) -> float:
    """Global batch / median step time, first `skip` steps (tracing) excluded."""
    records = run_dir.read_metrics()
    seconds = [r["seconds"] for r in records if "event" not in r and r.get("step", -1) >= skip]  # step lines, not eval lines
    return run_dir.train().global_batch_size / statistics.median(seconds)


def report(cluster_run: RunDir, standalone_run: RunDir, workers: int) -> tuple[list[str], bool]:
    """(lines to print, every worker computed on a GPU)."""
    lines, on_gpu = [], True
    for index in range(workers):
        log = cluster_run.log(f"worker-{index}")
        devices = placements(log.read_text(errors="replace")).get(index, Counter()) if log.exists() else Counter()
        if not devices:
            lines.append(f"worker-{index}: no placement logged in {log} (was PSTRAIN_LOG_DEVICE_PLACEMENT=1 set?)")
            on_gpu = False
            continue
        listed = ", ".join(f"{device} ({n} ops)" for device, n in devices.most_common())
        gpu = all("/device:GPU:" in d for d in devices)
        on_gpu &= gpu
        lines.append(f"worker-{index}: compute ops placed on {listed}" + ("" if gpu else "  <- not a GPU"))
    cluster, single = examples_per_second(cluster_run), examples_per_second(standalone_run)
    lines.append(
        f"throughput: pstrain {cluster:,.0f} examples/s ({workers} workers), one process {single:,.0f} examples/s, "
        f"pstrain / one process = {cluster / single:.2f}x"
    )
    return lines, on_gpu


def check(cluster_run: RunDir, standalone_run: RunDir) -> None:
    """Print the report; PstrainError when a worker did not compute on a GPU."""
    workers = len(cluster_run.record()["cluster"]["worker"])
    lines, on_gpu = report(cluster_run, standalone_run, workers)
    print("\n".join(lines), flush=True)
    if not on_gpu:
        raise PstrainError("gpu_check: a worker did not compute on a GPU (see above and its log)")


def main(argv: list[str]) -> int:
    try:
        check(RunDir(argv[0]), RunDir(argv[1]))  # the two runs' layouts, made once here and passed down
    except PstrainError as e:
        return errors.report(e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
