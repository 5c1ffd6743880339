"""pstrain's examples drawn as the peers draw theirs (issue 35): made on the workers, none repeated.

The peers make each step's batch where they compute it, with `tf.random.stateless_*` ops from a
fresh seed (tests/benchmarks/fair.py). A pstrain job gets the same: `train_dataset()` is
`Dataset.range(EXAMPLES).map(example)`, example i made by the workload's own draw from the stateless
seed [SALT, i]. pstrain builds the pipeline on each worker and reads it by position (docs/data.md),
so every example is made on the worker that computes on it and nothing passes through the chief; its
chief's shuffle walks through the EXAMPLES positions without repeating one, so a run of at most
EXAMPLES // global batch steps sees no example twice (`check_fits` refuses a longer one).
"""

from __future__ import annotations

from collections.abc import Callable

EXAMPLES = 1 << 20  # the chief's per-epoch permutation of them: 8 MiB
SALT = 0x5EED  # pstrain's seeds [SALT, i]; the peers' are [closure or worker, step]
DRAWN = "its train_dataset() of drawn examples, built and read by position on each worker (none repeated in a run)"


def drawn(example: Callable):
    """The tf.data.Dataset of EXAMPLES examples, element i = example(seed [SALT, i])."""
    import tensorflow as tf

    return tf.data.Dataset.range(EXAMPLES).map(lambda i: example(tf.stack([tf.constant(SALT, tf.int64), i])))


def check_fits(steps: int, batch: int) -> str:
    """'' when `steps` global batches of `batch` fit in EXAMPLES without a repeat, else why not (one line)."""
    if steps * batch <= EXAMPLES:
        return ""
    return (
        f"--steps {steps} x --global-batch-size {batch} reads {steps * batch:,} examples, more than the "
        f"{EXAMPLES:,} drawn: an example would repeat; give fewer steps"
    )
