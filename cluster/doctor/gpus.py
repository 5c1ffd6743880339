"""`pstrain doctor`'s checks of the workers' GPUs (pure: facts in, Check lines out)."""

from __future__ import annotations

from cluster.doctor.checks import REINSTALL, Check, Probe, Smi


def worker_gpus(
    assigned: dict[str, int | None], smi: Smi, probes: dict[str, Probe], wheel_is_cpu: bool, memory_mb: int = 0
) -> list[Check]:
    """Each local worker's GPU exists, workers that share one share it safely (memory growth, or
    `memory_mb` each that fit together), GPU and CPU workers are not mixed without a word, and
    TensorFlow (pinned to the GPU) shows exactly that one device and runs a matmul on it.
    `assigned`: worker name -> GPU index (None: no GPU)."""
    out = []
    total = {g.index: g.memory_total_mib for g in smi.gpus}
    owners: dict[int, list[str]] = {}
    for worker, gpu in assigned.items():
        if gpu is not None:
            owners.setdefault(gpu, []).append(worker)
    mixed = bool(owners) and None in assigned.values()
    for worker, gpu in sorted(assigned.items()):
        name = f"gpu.{worker}"
        if gpu is None:
            level = "WARN" if smi.gpus else "INFO"
            what = "no GPU assigned: it trains on the CPU"
            if mixed:
                what += ", beside workers on GPUs (asked by index): every synchronous step runs at its pace"
            fix = 'give it a GPU in cluster.worker_gpus (or "auto": the GPUs shared round-robin)' if smi.gpus else ""
            out.append(Check(level, name, what, fix))
            continue
        if gpu not in total:
            have = f"GPUs {sorted(total)}" if total else "no GPU"
            out.append(Check("FAIL", name, f"GPU {gpu} does not exist (nvidia-smi lists {have})", "fix cluster.worker_gpus"))
            continue
        sharers = owners[gpu]
        if len(sharers) > 1 and memory_mb * len(sharers) > total[gpu]:
            out.append(
                Check(
                    "FAIL",
                    name,
                    f"GPU {gpu} is shared by {', '.join(sharers)} at {memory_mb} MiB each, more than its {total[gpu]} MiB",
                    f"set cluster.worker_gpu_memory_mb to at most {total[gpu] // len(sharers)} (0: memory growth)",
                )
            )
        elif len(sharers) > 1:
            how = f"{memory_mb} MiB each" if memory_mb else "memory growth on"
            out.append(Check("INFO", f"{name}.shared", f"GPU {gpu} is shared by {', '.join(sharers)} ({how})"))
        probe = probes.get(worker)
        if probe is None:
            continue
        seen = f"CUDA_VISIBLE_DEVICES={probe.cuda_visible_devices}"
        if probe.error:
            out.append(
                Check(
                    "FAIL",
                    name,
                    f"TensorFlow failed under {seen}: {probe.error}",
                    "see the message; check the driver and CUDA libraries",
                )
            )
        elif not probe.gpus:
            fix = REINSTALL if wheel_is_cpu else "check the nvidia.driver and cuda.libraries lines above"
            out.append(Check("FAIL", name, f"TensorFlow sees no GPU under {seen}", fix))
        elif len(probe.gpus) != 1:
            out.append(
                Check(
                    "FAIL",
                    name,
                    f"TensorFlow sees {len(probe.gpus)} GPUs under {seen}, expected exactly 1",
                    "set one index per worker",
                )
            )
        elif "GPU" not in probe.matmul_device:
            out.append(
                Check("FAIL", name, f"a matmul under {seen} ran on {probe.matmul_device or 'nothing'}, not the GPU", REINSTALL)
            )
        else:
            out.append(
                Check("OK", name, f"GPU {gpu}: TensorFlow sees 1 device under {seen}; a matmul ran on {probe.matmul_device}")
            )
    return out


def gpu_memory(smi: Smi, own_pids: frozenset[int] = frozenset(), threshold_mib: int = 1024) -> list[Check]:
    """GPU memory already held by other processes (a worker pinned there may run out of memory)."""
    out = []
    for gpu in smi.gpus:
        procs = [p for p in smi.processes if p.gpu_uuid == gpu.uuid and p.pid not in own_pids]
        held = sum(p.used_mib for p in procs) if procs else gpu.memory_used_mib
        if held >= threshold_mib:
            who = ", ".join(f"pid {p.pid} {p.name} {p.used_mib} MiB" for p in procs) or "processes nvidia-smi does not list"
            out.append(
                Check(
                    "WARN",
                    f"gpu.memory.{gpu.index}",
                    f"{held} of {gpu.memory_total_mib} MiB on GPU {gpu.index} already in use ({who})",
                    "stop those processes or choose another GPU in cluster.worker_gpus",
                )
            )
    if smi.gpus and not out:
        out.append(Check("OK", "gpu.memory", f"no GPU has {threshold_mib} MiB or more held by other processes"))
    return out
