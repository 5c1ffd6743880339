"""The hybrid step's worker side (train.dense = "allreduce"): dense variables replicated on the workers.

- `WorkerCopy`: a ParameterServerStrategy per-worker variable whose handle is one placeholder per traced
  graph, so TF orders the reads and writes of one step (an optimizer reads a slot after updating it).
  TF's own PerWorkerVariable makes a new placeholder at each use, which leaves them unordered: measured,
  an Adam step then read stale slots and the workers' copies drifted apart.
- `exchanged_mean`: each slot's dense gradients gathered among the workers (CollectiveGatherV2, with the
  slot), put in slot order and averaged with the ops the ps's mean uses (add_n of the slots, then / N):
  bit for bit the standalone mean whatever the worker order. A ring all-reduce adds in the ring's order,
  which for 3+ workers is not the slot order (../shared/notes/hybrid.md, Q3); for 2 it is one addition,
  which commutes, so 2 workers sum with CollectiveReduceV2 (half the bytes received, no gathered copy).
- `reading`: the model's dense variables read as given tensors (the step's reads of the worker's copies)
  while a step is traced, so the gradients are taken for those tensors.
- `hybrid_step` and `apply_after_gate`: what worker/replica/loop.py runs per step in this mode: the
  slot's step on the copies and the exchange, then the copies' update once the ps applied the step.
- `lean_step`: the same step for a model without row-sparse tables, with no ps on its path (the loss
  and the stop request exchanged with the gradients; worker/replica/loop.py `lean_loop`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import tensorflow as tf
from tensorflow.python.distribute import ps_values
from tensorflow.python.eager import context
from tensorflow.python.framework import func_graph, ops
from tensorflow.python.saved_model import save_context

from worker.ps.gate import ABORT
from worker.replica.replica import replica_step

# A collective that loses a member fails at once (a killed peer: "Socket closed"); one whose peer hangs
# fails after this many seconds instead of waiting for ever (timeout 0).
COLLECTIVE_TIMEOUT_S = 60.0
# The exchange's own instance keys (the gather's; the 2-worker sum's packed gradients', then one more
# per gradient summed alone); the group key is the caller's (a fresh one per chief incarnation: a group
# that outlives a restarted task refuses it, "current incarnation doesn't match").
_INSTANCE_KEY, _SUM_INSTANCE_KEY = 2, 3
ALONE_BYTES = 1 << 20  # a 2-worker sum's gradient this large is a collective of its own (summed_mean)
_ROW_ALIGN_BYTES = 64  # Eigen's widest alignment (AVX-512): a slice starting on it aliases its tensor


class WorkerCopy(ps_values.PerWorkerVariable):
    """A per-worker variable read and written through one handle per traced graph (see the module)."""

    @property
    def handle(self):
        if context.executing_eagerly() or save_context.in_save_context():
            return self._coordinator_instance.handle
        self._maybe_create_per_worker_vars()
        closure, spec = self.handle_call_time_value()
        # Captured in the outermost function (the closure), which alone is fed at call time; a branch or
        # loop body inside it captures that tensor as any other (a call-time capture made in a cond's
        # branch is never fed: "You must feed a value for placeholder tensor ... with dtype resource").
        graph = ops.get_default_graph()
        while isinstance(getattr(graph, "outer_graph", None), func_graph.FuncGraph):
            graph = graph.outer_graph
        with graph.as_default():
            return graph.capture_call_time_value(closure, spec, key=("pstrain_worker_copy", id(self)))


def exchanged_mean(slot, grads: Sequence[tf.Tensor], num_slots: int, group_key: int) -> list[tf.Tensor]:
    """The mean over all `num_slots` slots (one per worker) of each dense gradient in `grads`, this
    slot's own included, summed in slot order as the aggregator sums them; every worker gets the same
    values. Two slots: a ring all-reduce's sum, each value one addition of the two slots' (a + b is b + a
    in IEEE arithmetic, so it is add_n's in slot order), then / 2, a collective per large gradient
    (`summed_mean`). More: one gather per step, one row per worker, the variables flattened, then the
    slot's bits (an integer as wide as the dtype, bitcast: a gather moves bits, so none is changed),
    summed in slot order."""
    return summed_mean(grads, group_key) if num_slots == 2 else gathered_mean(slot, grads, num_slots, group_key)


def gathered_mean(slot, grads: Sequence[tf.Tensor], num_slots: int, group_key: int) -> list[tf.Tensor]:
    """`exchanged_mean` by a gather of one row per worker, put in slot order and summed (any number of
    slots)."""
    dtype = grads[0].dtype
    bits = {2: tf.int16, 4: tf.int32, 8: tf.int64}[dtype.size]
    own = tf.bitcast(tf.cast(slot, bits), dtype)[tf.newaxis]
    sizes = [g.shape.num_elements() for g in grads]
    # Rows of whole 64-byte lines: TF then slices a row out of the gathered tensor without copying it
    # (measured on the dense 1 M row: the slot-order sum 1.6-2.1 ms aligned, 2.6-2.8 ms not).
    tail = -(sum(sizes) + 1) % (_ROW_ALIGN_BYTES // dtype.size) + 1  # the padding, then the slot
    row = tf.concat([*(tf.reshape(g, [-1]) for g in grads), tf.zeros([tail - 1], dtype), own], 0)[tf.newaxis]
    rows = tf.raw_ops.CollectiveGatherV2(
        input=row,
        group_size=num_slots,
        group_key=group_key,
        instance_key=_INSTANCE_KEY,
        ordering_token=[],
        timeout_seconds=COLLECTIVE_TIMEOUT_S,
    )
    order = tf.argsort(tf.bitcast(rows[:, -1], bits))  # rows[order[k]]: slot k's gradients, then its slot
    # Summed whole, then split: elementwise the same add_n and division as one variable at a time, with
    # no copy of a slot's row (a row of the gathered tensor is a view of it where TF can align it).
    mean = tf.add_n([rows[order[k]] for k in range(num_slots)]) / tf.cast(num_slots, dtype)
    parts = tf.split(mean, [*sizes, tail])[:-1]  # not the padding and the slots' column
    return [tf.reshape(part, g.shape) for part, g in zip(parts, grads, strict=True)]


def summed_mean(grads: Sequence[tf.Tensor], group_key: int) -> list[tf.Tensor]:
    """`exchanged_mean` of 2 slots: each gradient summed between the two workers by CollectiveReduceV2
    (merge Add: each value added once, in either order), divided by 2 as the aggregator divides. A
    gradient of `ALONE_BYTES` or more is a collective of its own, last layer first (see below; it is
    sent while the pass goes on, and needs no copy into or out of a packed vector);
    the smaller ones are flattened into one more. Packing changes no value: each is one addition."""
    alone = [i for i, g in enumerate(grads) if g.shape.num_elements() * g.dtype.size >= ALONE_BYTES]
    packed = [i for i, g in enumerate(grads) if i not in alone and g.shape.num_elements()]
    means: dict[int, tf.Tensor] = {}
    # Made last layer first: a traced function runs these collectives one after another in the order
    # they were made (auto control dependencies chain stateful ops), and the backward pass makes the
    # last layer's gradients first, so each is sent while the pass goes on to the layers before it.
    for k, i in reversed(list(enumerate(alone))):
        means[i] = _halved_sum(grads[i], group_key, _SUM_INSTANCE_KEY + 1 + k)
    if packed:
        sizes = [grads[i].shape.num_elements() for i in packed]
        flat = tf.concat([tf.reshape(grads[i], [-1]) for i in packed], 0)
        parts = tf.split(_halved_sum(flat, group_key, _SUM_INSTANCE_KEY), sizes)
        means |= {i: tf.reshape(part, grads[i].shape) for i, part in zip(packed, parts, strict=True)}
    return [means.get(i, g) for i, g in enumerate(grads)]  # an empty gradient is its own (empty) mean


def _halved_sum(value: tf.Tensor, group_key: int, instance_key: int) -> tf.Tensor:
    """`value` added to the other worker's of the same `instance_key` (a 2-worker ring all-reduce), then
    divided by 2 in the collective (final op Div: the same correctly rounded quotient as `/ 2`, with no
    pass of its own over the sum)."""
    return tf.raw_ops.CollectiveReduceV2(
        input=value,
        group_size=2,
        group_key=group_key,
        instance_key=instance_key,
        ordering_token=[],
        merge_op="Add",
        final_op="Div",
        timeout_seconds=COLLECTIVE_TIMEOUT_S,
    )


def places(model, variables: Sequence[tf.Variable]) -> list[tuple[object, str, int]]:
    """(layer, attribute, index into `variables`) for every layer attribute that holds one of `variables`;
    raises ValueError naming a variable no layer holds as a plain attribute."""
    wanted = {id(v): i for i, v in enumerate(variables)}
    found = [
        (layer, name, wanted[id(value)])
        for layer in model._flatten_layers(include_self=True)
        for name, value in vars(layer).items()
        if id(value) in wanted
    ]
    missing = set(range(len(variables))) - {i for _, _, i in found}
    if missing:
        raise ValueError(variables[min(missing)].name)
    return found


@contextlib.contextmanager
def reading(held: Sequence[tuple[object, str, int]], values: Sequence[tf.Tensor]) -> Iterator[None]:
    """While tracing: the layers in `held` (from `places`) see `values` in place of their variables, and
    so do their weight regularizers (`kernel_regularizer` and the like, which Keras computes from the
    variable itself, not from the layer's attribute). Set past Keras's attribute tracking, so the model's
    lists of weights do not change."""
    saved = [(layer, name, vars(layer)[name]) for layer, name, _ in held]
    by_id = {id(vars(layer)[name]): values[i] for layer, name, i in held}
    layers = list({id(layer): layer for layer, _, _ in held}.values())
    losses = [list(layer._callable_losses) for layer in layers]
    try:
        for layer, name, i in held:
            object.__setattr__(layer, name, values[i])
        for layer in layers:
            layer._callable_losses[:] = [reading_regularizer(loss, by_id) for loss in layer._callable_losses]
        yield
    finally:
        for layer, name, value in saved:
            object.__setattr__(layer, name, value)
        for layer, kept in zip(layers, losses, strict=True):
            layer._callable_losses[:] = kept


def reading_regularizer(loss, by_id: dict[int, tf.Tensor]):
    """A layer's callable loss with the variable it regularizes replaced by that variable's value in
    `by_id` (keyed by the variable's id); any other loss as it is. tf_keras keeps a weight regularizer as
    partial(_tag_callable, partial(_loss_for_variable, variable)) (base_layer.py add_loss and
    _handle_weight_regularization). A loss that reads a replicated variable some other way is caught by
    `replica_step`'s check (worker/replica/replica.py)."""
    inner = loss.args[0] if isinstance(loss, functools.partial) and len(loss.args) == 1 else None
    if isinstance(inner, functools.partial) and len(inner.args) == 1 and id(inner.args[0]) in by_id:
        return functools.partial(loss.func, functools.partial(inner.func, by_id[id(inner.args[0])]), **loss.keywords)
    return loss


def hybrid_step(replica, dense, batch, step, slot) -> tuple[list, list]:
    """One slot's step on this worker's copies (`dense`: chief/step/hybrid.py DenseCopies), the mean dense
    gradient exchanged among the workers. Returns what to push to the ps (the loss, NaN where the dense
    mean is not finite, so the ps withholds the step; the tables' gradients) and the dense means."""
    with tf.control_dependencies([dense.check_step(step)]):
        values = [copy.read_value() for copy in dense.copies]
    with reading(dense.held, values):
        loss, grads, _ = replica_step(replica, batch, step, slot, reads=dict(zip(dense.positions, values, strict=True)))
    means = exchanged_mean(slot, [grads[i] for i in dense.positions], replica.num_slots, dense.group_key)
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(m)) for m in means])
    loss = loss + tf.where(finite, tf.constant(0.0, loss.dtype), tf.constant(float("nan"), loss.dtype))
    return [loss, *(g for i, g in enumerate(grads) if i not in dense.positions)], means


def lean_step(replica, dense, batch, step, slot, stop) -> tuple[tf.Tensor, list, tf.Tensor, tf.Tensor]:
    """One slot's step of a model with no row-sparse table, with no ps on its path: the loss is
    exchanged with the dense gradients (the mean in slot order, as the ps's aggregator takes it) and so
    is `stop` (1.0 where this worker read the chief's stop request), so every worker decides the same.
    Returns (the mean loss, the dense means, whether all were finite, whether any worker saw a stop)."""
    with tf.control_dependencies([dense.check_step(step)]):
        values = [copy.read_value() for copy in dense.copies]
    with reading(dense.held, values):
        loss, grads, _ = replica_step(replica, batch, step, slot, reads=dict(zip(dense.positions, values, strict=True)))
    dtype = grads[dense.positions[0]].dtype
    extra = [tf.cast(loss, dtype)[tf.newaxis], tf.cast(stop, dtype)[tf.newaxis]]
    means = exchanged_mean(slot, [*(grads[i] for i in dense.positions), *extra], replica.num_slots, dense.group_key)
    means, (mean_loss, stopped) = means[:-2], means[-2:]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(m)) for m in [*means, mean_loss]])
    # NaN where a mean is not finite, as the gate's path pushes it (the withheld step's line says the loss is nan).
    mean_loss = tf.where(finite, tf.cast(mean_loss[0], loss.dtype), tf.constant(float("nan"), loss.dtype))
    return mean_loss, means, finite, stopped[0] > 0


def ps_applied(token: tf.Tensor, global_step: tf.Variable, step: tf.Tensor) -> tf.Tensor:
    """Whether the ps applied `step`, from `token`, what the gate's wait for step + 1 returned: step + 1
    (or a later step) says so; `ABORT` says only that the block ended, so the global step, read after
    it, decides (the apply moves it before it opens the next step or aborts a later one). A waiter that
    peeks while the queue holds the next step's token and then the abort that followed it can see the
    abort first (each peek puts its token back at the end), though the step was applied; the token
    alone would then leave this worker's copies a step behind the ps's tables."""
    with tf.device(global_step.device):
        return tf.cond(tf.equal(token, ABORT), lambda: global_step.read_value() > step, lambda: token > step)


def apply_after_gate(strategy, dense, gate, global_step, step, pushed, means) -> tf.Tensor:
    """Once `pushed` (after this slot's pushes) and the ps applied `step` (the gate opened the next one),
    the same update of this worker's copies; nothing where the ps did not apply it (withheld, stopped)."""
    with tf.control_dependencies([pushed]):
        applied = ps_applied(gate.wait(step + 1, global_step), global_step, step)
    # The optimizer's update in a replica context of its own, entered inside the branch (a merge_call
    # must not cross into a branch).
    update = lambda: tf.identity(strategy.run(dense.apply, args=(step, means)) > 0)  # noqa: E731
    return tf.cond(applied, update, lambda: tf.constant(False))
