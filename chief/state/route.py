"""Where a cluster's checkpoints are written: by each ps (chief/state/checkpoints.py) when every ps can
write to the checkpoint directory, else by the chief from a full copy (chief/state/mirror.py), which
only a model that fits the chief may take."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

import psutil
import tensorflow as tf

from chief.contract.framework import sharded_value
from chief.contract.job import Job
from chief.state.checkpoints import Checkpoints, checkpointed_variables, say
from chief.state.mirror import MirrorCheckpoints
from chief.state.model_state import ModelState
from cluster.errors import PstrainError

log = logging.getLogger("pstrain.chief")
PROBE = ".ps-can-write"  # RUN_DIR/checkpoints/.ps-can-write-N: what each ps writes to show it reaches the directory


def ps_devices(state: ModelState) -> list[str]:
    """The ps tasks that hold some of the state, as device names, by task index."""
    tasks = {tf.DeviceSpec.from_string(v.device).task for v in checkpointed_variables(state) if "/job:ps" in v.device}
    return [f"/job:ps/replica:0/task:{t}/device:CPU:0" for t in sorted(tasks)]


def unreachable_ps(directory: Path, devices: list[str]) -> list[str]:
    """The ps among `devices` whose writes into `directory` the chief does not see: each writes a random
    token to its own probe file there (`tf.io.write_file` on the ps), which the chief then reads."""
    directory.mkdir(parents=True, exist_ok=True)
    missing = []
    for device in devices:
        task = tf.DeviceSpec.from_string(device).task
        path, token = directory / f"{PROBE}-{task}", secrets.token_hex(8)
        try:
            with tf.device(device):
                tf.io.write_file(str(path), token)
            seen = path.read_text() == token
        except (tf.errors.OpError, OSError):
            seen = False
        path.unlink(missing_ok=True)
        if not seen:
            missing.append(f"ps:{task}")
    return missing


def chief_memory_bytes() -> int:
    """The memory this process could still take: the machine's available memory, or less under a
    cgroup limit (v2 `memory.max`, v1 `memory.limit_in_bytes`)."""
    available = psutil.virtual_memory().available
    for limit, usage in (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")):
        for root in _own_cgroups():
            try:
                cap = int((root / limit).read_text())
                available = min(available, cap - int((root / usage).read_text()))
            except (OSError, ValueError):  # no such file, or "max"
                continue
    return available


def _own_cgroups() -> list[Path]:
    """This process's cgroup directories (v2, and v1's memory controller)."""
    found = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found.append(Path("/sys/fs/cgroup") / path.lstrip("/"))
        elif "memory" in controllers.split(","):
            found.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/"))
    return found


def state_bytes(state: ModelState) -> int:
    """The size of everything a checkpoint holds (a shape known only when run counts 0)."""
    return sum((v.shape.num_elements() or 0) * v.dtype.size for v in checkpointed_variables(state))


def route(unreachable: list[str], size: int, free: int, directory: Path, keras3_split: bool = False) -> str:
    """ "direct" (each ps writes its shards) when every ps reaches `directory`; "mirror" (the chief writes a
    full copy) when one does not, or when a Keras 3 variable is split over ps (`keras3_split`: TF cannot
    save one, and its optimizer's slots are per shard), and the state (`size` bytes) fits in the chief's
    `free` memory; else a PstrainError saying what to do."""
    if keras3_split and size > free:
        raise PstrainError(
            f"a Keras 3 variable split across ps tasks is checkpointed from a full copy on the chief, and the model's state "
            f"({size / 2**30:.2f} GiB) is more than the chief can hold ({free / 2**30:.2f} GiB free): use --ps 1, "
            "or give the chief a machine with more memory"
        )
    if not unreachable and not keras3_split:
        return "direct"
    if size <= free:
        return "mirror"
    raise PstrainError(
        f"{', '.join(unreachable)} cannot write to {directory}, and the model's state ({size / 2**30:.2f} GiB) is more than "
        f"the chief can hold ({free / 2**30:.2f} GiB free): share {directory.parent} with every ps at the same path "
        "(a shared mount), or give the chief a machine with more memory"
    )


def open_checkpoints(live: ModelState, job: Job, sample, directory: Path, local: bool, say=say) -> Checkpoints:
    """The checkpoints of a run: the state's own (standalone, or a cluster whose ps all reach
    `directory`), or through the chief's mirror (a cluster whose ps do not, for a model that fits)."""
    if local:
        return Checkpoints(live, directory, say)
    missing = unreachable_ps(directory, ps_devices(live))
    size = state_bytes(live)
    keras3_split = any(sharded_value(v) is not None for v in live.model.weights)
    if route(missing, size, chief_memory_bytes(), directory, keras3_split) == "direct":
        log.info("checkpoints: each ps writes its own variables to %s; the chief writes the index", directory)
        return Checkpoints(live, directory, say)
    if keras3_split:
        log.info(
            "checkpoints: a Keras 3 variable is split over ps: the chief writes them from a full copy (%.1f MiB)", size >> 20
        )
        return MirrorCheckpoints(live, job, sample, directory, say)
    log.warning(
        "checkpoints: %s cannot write to %s (no shared mount?): the chief writes them from a full copy of the state (%.1f MiB)",
        ", ".join(missing),
        directory,
        size / 2**20,
    )
    return MirrorCheckpoints(live, job, sample, directory, say)


def split_over_ps(state: ModelState) -> bool:
    """Whether some variable of the state is split over ps tasks (a `ShardedVariable`)."""
    return any(getattr(v, "_sharded_container", None) is not None for v in checkpointed_variables(state))


def serving_model(checkpoints: Checkpoints, job: Job, sample):
    """The model to export, or None when it cannot be: the training state's own where TF exports it as
    it is (each ps writes its variables), else a full copy on the chief, which only a model that fits
    the chief may take. TF 2.21 exports a variable split over ps with each shard replaced by the full
    variable on load, so a lookup past the first shard read wrong rows (measured): such a model is copied."""
    live = checkpoints.live
    if isinstance(checkpoints, MirrorCheckpoints) or not split_over_ps(live):
        return checkpoints.model()
    if state_bytes(live) > chief_memory_bytes():
        return None
    log.info("export: a variable is split over ps; the SavedModel is written from a copy on the chief")
    return MirrorCheckpoints(live, job, sample, checkpoints.directory, checkpoints.say).model()
