"""pstrain's examples drawn as the peers draw theirs (issue 35): made on the workers, none repeated.

The peers make each step's batch where they compute it, with `tf.random.stateless_*` ops from a
fresh seed (tests/benchmarks/fair.py). A pstrain job gets the same: `train_dataset()` is
`Dataset.range(EXAMPLES)` mapped to example i: the workload's own `fresh_batch` draw of a batch of
one from the stateless seed [SALT, i], unbatched (`one_example`). pstrain builds the pipeline on each
worker and reads it by position (docs/data.md), so every example is made on the worker that computes
on it and nothing passes through the chief; its
chief's shuffle walks through the EXAMPLES positions without repeating one, so a run of at most
EXAMPLES // global batch steps sees no example twice (`check_fits` refuses a longer one).
"""

from __future__ import annotations

from collections.abc import Callable

EXAMPLES = 1 << 20  # the chief's per-epoch permutation of them: 8 MiB
SALT = 0x5EED  # pstrain's seeds [SALT, i]; the peers' are [closure or worker, step]
DRAWN = "its train_dataset() of drawn examples, built and read by position on each worker (none repeated in a run)"


def one_example(fresh_batch: Callable, seed, size: str = ""):
    """One example drawn as a workload's `fresh_batch(seed, n, size)` (tests/benchmarks/fair.py) draws
    each of its n: its batch of one, unbatched (the same structure: a tensor, a tuple, a dict)."""
    import tensorflow as tf

    return tf.nest.map_structure(lambda t: t[0], fresh_batch(seed, 1, size))


def drawn(fresh_batch: Callable, size: str = ""):
    """The tf.data.Dataset of EXAMPLES examples, element i = one_example(fresh_batch, seed [SALT, i], size)."""
    import tensorflow as tf

    def example(i):
        return one_example(fresh_batch, tf.stack([tf.constant(SALT, tf.int64), i]), size)

    return tf.data.Dataset.range(EXAMPLES).map(example)


def check_fits(steps: int, batch: int) -> str:
    """'' when `steps` global batches of `batch` fit in EXAMPLES without a repeat, else why not (one line)."""
    if steps * batch <= EXAMPLES:
        return ""
    return (
        f"--steps {steps} x --global-batch-size {batch} reads {steps * batch:,} examples, more than the "
        f"{EXAMPLES:,} drawn: an example would repeat; give fewer steps"
    )
