"""State a model changes in its forward pass (BatchNormalization's moving statistics), made synchronous.

While a replica's step is traced, `assign`, `assign_add` and `assign_sub` on the model's
non-trainable variables are intercepted: nothing is written, the change is recorded as a delta
against the step's starting value. The engines push the deltas of each slot like gradients and
apply their mean once per step, after the optimizer; a dropped (stale, backup) slot's deltas are
dropped with its gradients. Since BatchNormalization's moving average is linear in the batch
statistics, the mean delta is one update from the mean of the per-slot statistics: what
MirroredStrategy's read-averaged replica copies amount to.

Writes that bypass these methods (raw ops) and stateful random ops cannot be made synchronous;
`chief.contract.graph_ops.unsupported_ops` finds them in a traced graph so such a job is refused instead of trained wrongly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import tensorflow as tf

METHODS = ("assign", "assign_add", "assign_sub")


class Captured:
    """Deltas recorded for the watched variables during one forward pass."""

    def __init__(self, variables: Sequence[tf.Variable]):
        self.variables = list(variables)
        self._delta: dict[int, tf.Tensor] = {}

    @property
    def touched(self) -> list[int]:
        """Positions (in `variables`) of the variables the forward pass assigned."""
        return [i for i, v in enumerate(self.variables) if id(v) in self._delta]

    def record(self, variable, method: str, value) -> tf.Tensor:
        value = tf.cast(tf.convert_to_tensor(value), variable.dtype.base_dtype)
        delta = self._delta.get(id(variable))
        if method == "assign":
            new_delta = value - variable.read_value()  # nothing was written: the read is the starting value
        elif method == "assign_add":
            new_delta = value if delta is None else delta + value
        else:
            new_delta = -value if delta is None else delta - value
        self._delta[id(variable)] = new_delta
        return variable.read_value() + new_delta

    def deltas(self) -> list[tf.Tensor]:
        """One delta per watched variable, in their order (zeros for a variable this pass left alone)."""
        # tf.shape: a variable's static shape may be partly unknown (TextVectorization's idf_weights).
        return [self._delta.get(id(v), tf.zeros(tf.shape(v), v.dtype.base_dtype)) for v in self.variables]


@contextlib.contextmanager
def capture_assigns(variables: Sequence[tf.Variable]) -> Iterator[Captured]:
    """Within the block, assignments to `variables` are recorded as deltas, not written."""
    captured = Captured(variables)
    watched = {id(v) for v in variables}
    patched: list[tuple[type, str, object]] = []
    for cls in {type(v) for v in variables}:
        for method in METHODS:
            original = getattr(cls, method)
            own = cls.__dict__.get(method)

            def intercept(self, value, *args, _original=original, _method=method, **kwargs):
                if id(self) in watched:
                    return captured.record(self, _method, value)
                return _original(self, value, *args, **kwargs)

            setattr(cls, method, intercept)
            patched.append((cls, method, own))
    try:
        yield captured
    finally:
        for cls, method, own in reversed(patched):
            if own is None:
                delattr(cls, method)
            else:
                setattr(cls, method, own)


def layer_of(op_name: str, layer_names: Sequence[str]) -> str:
    """The model layer whose name scope holds `op_name` (the op name itself when none does)."""
    parts = op_name.split("/")
    for part in parts:
        if part in layer_names:
            return part
    return op_name
