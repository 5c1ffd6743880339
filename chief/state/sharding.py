"""Variables split across ps tasks, matched to the full-size variables of an unsharded twin.

With more than one ps, the chief creates variables through TF's `MinSizePartitioner`, so a large
variable becomes shards along axis 0 (`kernel/part_0`, `kernel/part_1`, …) on different ps tasks,
and Keras lists the shards in place of the variable. The checkpoint mirror (and with it checkpoints
and the exported model) is full-size; these helpers move values between the two layouts.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

# Shards of at least this many bytes, at most one per ps: small variables (biases) stay whole.
MIN_SHARD_BYTES = 256 << 10
# The most bytes `copy_rows` moves at once.
CHUNK_BYTES = 16 << 20


def partitioner(num_ps: int):
    """The variable partitioner for `num_ps` ps tasks (None: whole variables). A variable whose shape is
    known only when run (TextVectorization's tf-idf weights) stays whole."""
    if num_ps < 2:
        return None
    by_size = tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=MIN_SHARD_BYTES, max_shards=num_ps)

    def partition(shape: tf.TensorShape, dtype: tf.DType) -> list[int]:
        return by_size(shape, dtype) if shape.is_fully_defined() else [1] * shape.rank

    return partition


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


def copy_rows(sources: Sequence[tf.Variable], targets: Sequence[tf.Variable], chunk_bytes: int = CHUNK_BYTES) -> None:
    """Copy the value that `sources` stack into (along axis 0) into `targets`, another split of the same
    rows (shards into one full-size variable, or back). Chunks of at most `chunk_bytes` are gathered
    where their source lives and scattered where their target lives, so no full-size value exists
    anywhere in between. (A dense write of part of a variable would read all of it first.)"""
    whole = len(sources) == 1 and len(targets) == 1
    if whole and (not sources[0].shape.is_fully_defined() or _bytes(sources[0]) <= chunk_bytes):
        targets[0].assign(sources[0].read_value())  # small, scalar, or of a shape known only when run: in one piece
        return
    row_bytes = max(1, _bytes(sources[0]) // max(1, sources[0].shape[0]))
    step = max(1, chunk_bytes // row_bytes)
    src_starts, dst_starts = _starts(sources), _starts(targets)
    for source, s0 in zip(sources, src_starts, strict=True):
        for target, t0 in zip(targets, dst_starts, strict=True):
            low, high = max(s0, t0), min(s0 + source.shape[0], t0 + target.shape[0])
            for a in range(low, high, step):
                b = min(a + step, high)
                with tf.device(source.device):
                    values = source.sparse_read(tf.range(a - s0, b - s0))
                target.scatter_update(tf.IndexedSlices(values, tf.range(a - t0, b - t0)))


def _bytes(variable: tf.Variable) -> int:
    return variable.shape.num_elements() * variable.dtype.size


def _starts(variables: Sequence[tf.Variable]) -> list[int]:
    """The first row of each variable in the value they stack into."""
    starts, row = [], 0
    for v in variables:
        starts.append(row)
        row += v.shape[0]
    return starts


def placement_summary(variables: Sequence[tf.Variable]) -> str:
    """Where the variables live: per ps task, how many and how many bytes; which were split."""
    per_task: dict[str, list[int]] = {}
    parts: dict[str, int] = {}
    for v in variables:
        task = _task(v.device)
        count_bytes = per_task.setdefault(task, [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += (v.shape.num_elements() or 0) * v.dtype.size  # 0: a shape known only when run
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
