"""Keras 3 variables split over ps tasks: the optimizer built on the shards, and its slots in the order
of an unsharded twin.

Under a ParameterServerStrategy with a partitioner (chief/state/sharding.py) a Keras 3 variable wraps
a `ShardedVariable` (its `.value`). Keras 3 itself neither takes gradients for nor applies them to
one (shared/notes/keras3.md), so pstrain takes the shards as the trainable variables (`shards_of`, chief/contract/framework.py),
as tf_keras lists them, and builds the Keras 3 optimizer on the shards (`build_on_shards`): its slots
are then shards of the full-size slots, each colocated with its variable, and an elementwise update
gives each shard exactly its rows of the whole update. What is not elementwise over a variable (a
per-variable norm, a factored moment, a constraint over a column) is refused (`refuse_sharded`).

A Keras 3 optimizer creates its slots variable by variable (Adam: momentum and velocity of the first
variable, then of the second), so the slots of one variable's shards are not consecutive; `slot_order`
lists them so, which is how the checkpoint mirror (chief/state/mirror.py) pairs shards with the
full-size slot they stack into.
"""

from __future__ import annotations

import weakref
from typing import Any

from chief.contract.framework import KERAS3, framework_of, sharded_value, shards_of
from chief.contract.job import JobError

# Keras 3 optimizers whose update of a variable is elementwise (each shard's update is its rows of
# the whole update): the ones that may be built on shards.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Nadam", "Ftrl", "Lion")

# optimizer -> {id(slot): (id(the shard or variable it was made for), its name)}, recorded while built.
_SLOT_REFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def build_on_shards(optimizer: Any, variables: list) -> None:
    """`optimizer.build` on `shards_of(variables)` (Keras 3 variables, some split over ps), recording
    which variable each slot was made for (`slot_order`)."""
    references: dict[int, tuple[int, str]] = {}
    made_for = optimizer.add_variable_from_reference

    def recording(reference_variable, name=None, initializer="zeros"):
        slot = made_for(reference_variable, name=name, initializer=initializer)
        references[id(slot)] = (id(reference_variable), name)
        return slot

    optimizer.add_variable_from_reference = recording
    try:
        optimizer.build(shards_of(variables))
    finally:
        del optimizer.add_variable_from_reference
    _SLOT_REFERENCES[optimizer] = references


def slot_order(optimizer: Any, model_variables: list, optimizer_variables: list) -> list:
    """`optimizer_variables` (the Keras 3 optimizer's, in its order) with the slots of a split
    variable's shards made consecutive, at the place of the first shard's slot: the order in which the
    same optimizer built on whole variables lists its full-size slots. Other optimizers: unchanged."""
    references = _SLOT_REFERENCES.get(optimizer) if framework_of(optimizer) == KERAS3 else None
    if not references:
        return optimizer_variables
    siblings: dict[int, list[int]] = {}  # id(shard) -> ids of all the shards of its variable
    for v in model_variables:
        if (value := sharded_value(v)) is not None:
            ids = [id(s) for s in value.variables]
            siblings.update(dict.fromkeys(ids, ids))
    by_reference = {references[id(s)]: s for s in optimizer_variables if id(s) in references}
    ordered, placed = [], set()
    for slot in optimizer_variables:
        if id(slot) in placed:
            continue
        reference, name = references.get(id(slot), (None, None))
        group = [by_reference[(shard, name)] for shard in siblings.get(reference, [])] or [slot]
        ordered += group
        placed.update(id(s) for s in group)
    return ordered


def refuse_sharded(spec: str, model: Any, optimizer: Any) -> None:
    """Raise JobError (one line) for what would not train exactly with a Keras 3 variable split over ps
    (`split_refusal`)."""
    if framework_of(optimizer) != KERAS3:
        return
    for v in model.trainable_variables:
        if sharded_value(v) is not None and (reason := split_refusal(optimizer, v)):
            raise JobError(f"--job {spec}: {reason}")


def split_refusal(optimizer: Any, variable: Any) -> str | None:
    """Why the Keras 3 `variable` would not train exactly split over ps with the Keras 3 `optimizer`
    (the line's text after `--job SPEC: `): an optimizer whose update is not elementwise, weight-decay
    exclusions, a constraint (NonNeg aside); None where it would. `pstrain plan` says it before measuring."""
    import keras

    fix = "use --ps 1 (no variable is split)"
    kind = type(optimizer).__name__
    if kind not in ELEMENTWISE:
        return (
            f"optimizer_fn: a Keras 3 {kind} updates {variable.path} as a whole, which is split across ps "
            f"tasks; {fix}, or one of {', '.join(ELEMENTWISE)}"
        )
    if getattr(optimizer, "_exclude_from_weight_decay", None) or getattr(optimizer, "_exclude_from_weight_decay_pattern", None):
        return f"optimizer_fn: exclude_from_weight_decay with a variable split across ps tasks; {fix}"
    if variable.constraint is not None and not isinstance(variable.constraint, keras.constraints.NonNeg):
        return (
            f"model_fn: {variable.path} has a {type(variable.constraint).__name__} constraint and is split across ps "
            f"tasks, where it would apply per shard; {fix}, or drop the constraint (NonNeg works on shards)"
        )
    return None
