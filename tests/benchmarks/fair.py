"""TF2 peers at their best, for any workload (tests/benchmarks/jobs.py, embeddings.py).

Each role runs in its own process and prints one JSON line: {"samples": [[applied global steps,
wall time], ...], "setup": how it ran, ...}; tests/benchmarks/window.py turns samples into start-up
and step time, the same way for every peer. A workload module gives build_model(size), loss(y, logits),
optimizer() and fresh_batch(seed, n, size): a batch of n examples made by tf.random.stateless_* ops from a
[2] seed, so every step of every peer reads a fresh batch made where it computes.

- async: TF2 ParameterServerStrategy as Keras's steps_per_execution runs it: a tf.function loops
  `for i in tf.range(k): strategy.run(replica)`, data made on the worker inside `replica`, and every
  closure of the run is scheduled before one join (the first round of one step per worker aside: the
  start-up event). A global step = one global batch = `workers` updates of a half batch each.
- async-1step: one step per closure and a join after every global step (the harness's older form).
- mwms: MultiWorkerMirroredStrategy, the same tf.range loop around strategy.run in one tf.function.
- single: one process, the same loop.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import time

import tensorflow as tf

PER_DISPATCH = 16  # steps per closure or call when no sweep chose one (dense 1 M: K=1 23.8 ms, 16 15.8, 64 16.9)
DATA = "data made on the workers (tf.random.stateless_*, a fresh batch every step)"


def emit(samples: list, setup: str, **extra) -> None:
    print(json.dumps({"samples": samples, "setup": setup, **extra}), flush=True)


def chunks(steps: int, k: int) -> list[int]:
    """A run of `steps` as dispatches: one step first (the start-up event), then k at a time."""
    rest = max(steps - 1, 0)
    return [1] + [k] * (rest // k) + ([rest % k] if rest % k else [])


def looped(workload, size: str, model, opt, strategy, per: int, replicas: int = 1):
    """tf.function(seed_base [2] int64, k): k steps of `replica`, each on a fresh batch; returns the
    optimizer's iterations after them. `replicas` divides the loss where gradients are summed (MWMS)."""

    def replica(seed):
        x, y = workload.fresh_batch(seed, per, size)
        with tf.GradientTape() as tape:
            value = workload.loss(y, model(x, training=True)) / replicas
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    @tf.function
    def run(base, k):
        for i in tf.range(k):
            strategy.run(replica, args=(base + tf.stack([tf.constant(0, tf.int64), i]),))
        return opt.iterations.read_value()

    return run


def built(workload, size: str, strategy):
    with strategy.scope():
        model, opt = workload.build_model(size), workload.optimizer()
        _ = opt.iterations  # created now, in the strategy's scope
    return model, opt


def role_async(workload, size: str, batch: int, steps: int, k: int) -> None:
    """TF2 PS async: k steps per closure, all closures before one join (k = 1: join every global step)."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    workers = resolver.cluster_spec().num_tasks("worker")
    model, opt = built(workload, size, strategy)
    run = looped(workload, size, model, opt, strategy, batch // workers)
    seed = lambda c: tf.constant([c, 0], tf.int64)  # noqa: E731  closure c's batches: [c, 0..k-1]
    samples, closures = [], 0
    if k == 1:  # one step per closure, a join per global step
        for step in range(steps):
            for _ in range(workers):
                coordinator.schedule(run, args=(seed(closures), tf.constant(1, tf.int64)))
                closures += 1
            coordinator.join()
            samples.append([step + 1, time.time()])
        setup = f"1 step per closure, a join after every global step ({workers} closures), {DATA}"
    else:
        plan = chunks(steps, k)
        values = []
        for n in plan:  # every worker does `steps` updates of its half batch: `steps` global steps
            for _ in range(workers):
                values.append(coordinator.schedule(run, args=(seed(closures), tf.constant(n, tf.int64))))
                closures += 1
            if n == 1 and len(values) == workers:
                coordinator.join()  # the first global step: the start-up event, as for every peer
                samples += [[int(v.fetch()) / workers, time.time()] for v in values]
        for v in values[workers:]:
            samples.append([int(v.fetch()) / workers, time.time()])
        coordinator.join()
        setup = f"{k} steps per closure (tf.range around strategy.run), {closures - workers} closures before one join, {DATA}"
    iterations = int(opt.iterations.numpy())
    emit(samples, setup, per_closure=k, closures=closures, iterations=iterations, workers=workers)


def digest(variables) -> str:
    h = hashlib.sha256()
    for v in variables:
        h.update(v.numpy().tobytes())
    return h.hexdigest()[:16]


def sums(variables) -> list[float]:
    """Each variable's sum in float64: equal across replicas that all-reduce (up to the order in which
    a sparse update's duplicate rows are added), apart where they train on their own batches."""
    return [float(tf.reduce_sum(tf.cast(v, tf.float64))) for v in variables]


def role_mwms(workload, size: str, batch: int, steps: int, k: int) -> None:
    """MultiWorkerMirroredStrategy: k synchronous all-reduced steps per tf.function call."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = tf.distribute.cluster_resolver.TFConfigClusterResolver().task_id
    model, opt = built(workload, size, strategy)
    initial = sums(model.trainable_variables)
    replicas = strategy.num_replicas_in_sync
    run = looped(workload, size, model, opt, strategy, batch // replicas, replicas)
    samples, done = [], 0
    for n in chunks(steps, k):  # each worker's data: seeds [index, step]
        iterations = run(tf.constant([index, done], tf.int64), tf.constant(n, tf.int64))
        samples.append([int(iterations.numpy()), time.time()])
        done += n
    first_x, _ = workload.fresh_batch(tf.constant([index, 0], tf.int64), batch // replicas, size)
    setup = f"{k} steps per tf.function call (tf.range around strategy.run), all-reduce of the gradients, {DATA}"
    final = sums(model.trainable_variables)
    emit(samples, setup, per_call=k, index=index, initial_sums=initial, sums=final, data_digest=digest(tf.nest.flatten(first_x)))


def role_single(workload, size: str, batch: int, steps: int, k: int) -> None:
    strategy = tf.distribute.get_strategy()
    model, opt = workload.build_model(size), workload.optimizer()
    run = looped(workload, size, model, opt, strategy, batch)
    samples, done = [], 0
    for n in chunks(steps, k):
        iterations = run(tf.constant([0, done], tf.int64), tf.constant(n, tf.int64))
        samples.append([int(iterations.numpy()), time.time()])
        done += n
    emit(samples, f"one process, {k} steps per tf.function call, data made in the process", per_call=k)


def drive_moves(coordinator, bodies: list, steps: int, k: int) -> tuple[list, str]:
    """The transfer probe: each body moves one worker's bytes of a step (a pull and a push). k = 1: a
    closure per body and a join every step; k > 1: k moves per closure, every closure before one join
    (the tuned async peer's dispatch), so no coordinator round trip sits between steps."""

    def make(body):
        @tf.function
        def move(n):
            for _ in tf.range(n):
                body()
            return tf.constant(0)

        return move

    moves = [make(body) for body in bodies]
    samples, done = [], 0
    if k == 1:
        for step in range(steps):
            for move in moves:
                coordinator.schedule(move, args=(tf.constant(1, tf.int64),))
            coordinator.join()
            samples.append([step + 1, time.time()])
        return samples, "closures that only move a step's bytes, 1 step per closure, a join every step"
    scheduled = [(n, [coordinator.schedule(m, args=(tf.constant(n, tf.int64),)) for m in moves]) for n in chunks(steps, k)]
    for n, values in scheduled:
        for v in values:
            v.fetch()
        done += n
        samples.append([done, time.time()])
    coordinator.join()
    return samples, f"closures that only move a step's bytes, {k} steps per closure, every closure before one join"


ROLES = {
    "async": role_async,
    "async-1step": lambda w, s, b, n, k: role_async(w, s, b, n, 1),
    "mwms": role_mwms,
    "single": role_single,
}


def run_role(workload_module: str, role: str, size: str, batch: int, steps: int, k: int | None = None) -> None:
    """Run TF2 peer `role` on a workload module; `k` steps per closure or call (None: PER_DISPATCH)."""
    ROLES[role](importlib.import_module(workload_module), size, batch, steps, k or PER_DISPATCH)
