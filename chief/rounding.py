"""One rounding for every engine: the graph rewrites that would round a slot's step differently on
the cluster than in one process, switched off in the process that builds the step functions.

Grappler's arithmetic optimizer and remapper decide per graph (from device placement and which ops
share a consumer) whether to merge chains of adds into one `AddN` in another order, hoist common
factors or fuse ops. A worker's closure, where table lookups and variable reads run on the ps, and
the standalone step, where everything shares one device and both slots one graph, were rewritten
differently: the same step rounded differently (in the last bit, from the first steps on), and
long runs drifted (README, "The proof that training is synchronous"). With both off, a cluster run
without backup slots equals the standalone run bit for bit (tests/test_engines.py). The setting is
the calling process's; functions it runs on remote workers are optimized with its options.
"""

from __future__ import annotations

import tensorflow as tf

REWRITES_OFF = {"arithmetic_optimization": False, "remapping": False}


def same_rounding_everywhere() -> None:
    """Switch off the rewrites that round differently per graph (before any step function is traced)."""
    tf.config.optimizer.set_experimental_options(REWRITES_OFF)
