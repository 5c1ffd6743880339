"""Variables split across ps tasks, matched to the full-size variables of an unsharded twin.

With more than one ps, the chief creates variables through TF's `MinSizePartitioner`, so a large
variable becomes shards along axis 0 (`kernel/part_0`, `kernel/part_1`, …) on different ps tasks,
and Keras lists the shards in place of the variable. The checkpoint mirror (and with it checkpoints
and the exported model) is full-size; these helpers move values between the two layouts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

# Shards of at least this many bytes, at most one per ps: small variables (biases) stay whole.
MIN_SHARD_BYTES = 256 << 10


def partitioner(num_ps: int):
    """The variable partitioner for `num_ps` ps tasks (None: whole variables)."""
    if num_ps < 2:
        return None
    return tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=MIN_SHARD_BYTES, max_shards=num_ps)


def shard_groups(shard_shapes: Sequence[Sequence[int]], full_shapes: Sequence[Sequence[int]]) -> list[range]:
    """For each full shape, the consecutive shards that stack into it along axis 0.

    Both lists are in the same order (a model's weights, an optimizer's variables); raises
    ValueError when they cannot be matched.
    """
    groups, i = [], 0
    for full in map(tuple, full_shapes):
        start = i
        if i < len(shard_shapes) and tuple(shard_shapes[i]) == full:  # a whole (unsharded) variable
            i += 1
        else:
            rows = 0
            while full and i < len(shard_shapes) and rows < full[0]:
                shard = tuple(shard_shapes[i])
                if not shard or shard[1:] != full[1:] or rows + shard[0] > full[0]:
                    break
                rows, i = rows + shard[0], i + 1
            if not full or rows != full[0]:
                raise ValueError(f"no shards make up a variable of shape {list(full)} (shards from index {start})")
        groups.append(range(start, i))
    if i != len(shard_shapes):
        raise ValueError(f"{len(shard_shapes) - i} shard(s) left over after matching {len(full_shapes)} variables")
    return groups


def read_full(shards: Sequence[tf.Variable]) -> tf.Tensor:
    """The full value of a variable from its shards."""
    values = [s.read_value() for s in shards]
    return values[0] if len(values) == 1 else tf.concat(values, axis=0)


def assign_full(shards: Sequence[tf.Variable], value) -> None:
    """Give shards the rows of the full `value` that each holds."""
    if len(shards) == 1:
        shards[0].assign(value)
        return
    value, offset = np.asarray(value), 0
    for shard in shards:
        rows = shard.shape[0]
        shard.assign(value[offset : offset + rows])
        offset += rows


def placement_summary(variables: Sequence[tf.Variable]) -> str:
    """Where the variables live: per ps task, how many and how many bytes; which were split."""
    per_task: dict[str, list[int]] = {}
    parts: dict[str, int] = {}
    for v in variables:
        task = _task(v.device)
        count_bytes = per_task.setdefault(task, [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += v.shape.num_elements() * v.dtype.size
        if "/part_" in v.name:
            name = v.name.split("/part_")[0]
            parts[name] = parts.get(name, 0) + 1
    tasks = ", ".join(f"{task} {n} variables {size / 2**20:.1f} MiB" for task, (n, size) in sorted(per_task.items()))
    split = ", ".join(f"{name} ({n} shards)" for name, n in parts.items()) or "none"
    return f"{tasks}; split across ps: {split}"


def _task(device: str) -> str:
    """'/job:ps/replica:0/task:1/device:CPU:0' -> 'ps:1'."""
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.job}:{spec.task}"
