"""One rounding for every engine: the graph rewrites that would round a slot's step differently on
the cluster than in one process, switched off in the process that builds the step functions.

Grappler's arithmetic optimizer and remapper decide per graph (from device placement and which ops
share a consumer) whether to merge chains of adds into one `AddN` in another order, hoist common
factors or fuse ops. The standalone step, where both slots share one graph and one device, was
rewritten unlike a worker's closure: the same step rounded differently (in the last bit, from step 7
of the BatchNorm CNN `tests/jobs/keras_models.py:Mixed` on), and long runs drifted. With both off, a
cluster run without backup slots equals the standalone run bit for bit (docs/faults.md, "Exact for
long runs"). Set in the chief too: a multi-process cluster's closures came out the same either way
(measured), but in-process clusters (tests/chief/step/test_dispatch.py) run the closures under these options.
"""

from __future__ import annotations

import tensorflow as tf

REWRITES_OFF = {"arithmetic_optimization": False, "remapping": False}


def same_rounding_everywhere() -> None:
    """Switch off the rewrites that round differently per graph (before any step function is traced)."""
    tf.config.optimizer.set_experimental_options(REWRITES_OFF)
