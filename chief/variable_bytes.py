"""The bytes each trainable variable moves per step, from the user's job: `pstrain plan` runs
`python -m chief.variable_bytes JOB EXAMPLES_PER_WORKER`, which prints one JSON object: "variables", a
list of {name, bytes, rows, pull_bytes, push_bytes, split_refused, row_sparse}; "allreduce_refused", why
train.dense = "allreduce" refuses the job ("" where it takes it); "slots", the optimizer's slots per
dense variable (Adam's 2) (cluster/ imports no chief/ module but the CLI's entry points).

A variable whose gradient is an `IndexedSlices` (an embedding's table) is row-sparse: a worker
pulls and pushes only the rows its batch touches (docs/embeddings.md), counted here on a sample of
one worker's batch (positions drawn with a fixed seed). Any other variable moves whole, both ways.
Which rows a gradient touches does not depend on the loss, so the probe differentiates the sum of
the model's outputs.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np


def job_variables(spec: str, examples_per_worker: int) -> list[dict]:
    """The job's trainable variables, each with its bytes per worker per step."""
    return job_summary(spec, examples_per_worker)["variables"]


def job_summary(spec: str, examples_per_worker: int) -> dict:
    """What `main` prints (see the module): the variables, and what train.dense = "allreduce" makes of the job."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf

    from chief.contract.framework import trainable_of, variables_of
    from chief.contract.job import load_job
    from worker.replica.forward_state import capture_assigns

    job = load_job(spec)
    features = sample_features(job, max(1, examples_per_worker))
    model = job.model_fn()
    candidates = variables_of(model.non_trainable_weights)
    with capture_assigns(candidates) as captured, tf.GradientTape() as tape:  # assigns recorded, not written
        outputs = model(features, training=True)
        total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in tf.nest.flatten(outputs)])
    variables = trainable_of(model)  # tf.Variables, a Keras 3 model's too
    gradients = tape.gradient(total, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    refused = split_refusals(job, model) or [""] * len(variables)
    described = [{**describe(v, g), "split_refused": r} for v, g, r in zip(variables, gradients, refused, strict=True)]
    state = tuple(candidates[i] for i in captured.touched)
    sparse = tuple(d["row_sparse"] for d in described)
    why, slots = allreduce_of(job, model, state, sparse)
    return {"variables": described, "allreduce_refused": why, "slots": slots}


def allreduce_of(job: Any, model: Any, state: tuple, sparse: tuple[bool, ...]) -> tuple[str, int]:
    """(why train.dense = "allreduce" refuses the job, "" where it takes it; the optimizer's slot variables
    per dense variable) by the launch's own check (chief/step/hybrid.py `refusal`), with the settings
    `pstrain plan` runs (one slot per worker, no backup workers). A dense variable split over ps is the
    plan's own check per ps count (cluster/forecast/model.py `allreduce_refusal`): here the model is whole."""
    from chief.contract.framework import trainable_of
    from chief.state.model_state import create_optimizer_slots
    from chief.step.hybrid import refusal, slot_count
    from cluster.config import TrainConfig
    from worker.replica.replica import Replica

    optimizer = job.optimizer_fn()
    replica = Replica(job, model, optimizer, state, 0, 1, sparse)
    why = refusal(job, TrainConfig(replicas_to_aggregate=1, total_num_replicas=1), replica, 1)
    if why is not None:
        return why, 0
    create_optimizer_slots(optimizer, [v for v, rows in zip(trainable_of(model), sparse, strict=True) if not rows])
    return "", slot_count(optimizer)


def split_refusals(job: Any, model: Any) -> list[str]:
    """Per trainable variable: why the launch would refuse it split over ps (a Keras 3 job's Lamb,
    Adafactor, Muon, a constraint: chief/state/keras3_shards.py), or "" where it trains split; none
    for a tf_keras job (nothing of it is refused split)."""
    from chief.contract.framework import KERAS3, framework_of
    from chief.state.keras3_shards import split_refusal

    if framework_of(model) != KERAS3:
        return []
    optimizer = job.optimizer_fn()
    return [split_refusal(optimizer, v) or "" for v in model.trainable_variables]


def describe(variable: Any, gradient: Any) -> dict:
    """A variable's sizes; a row-sparse gradient moves its unique rows (and their int64 indices), both
    ways: a lookup gathers on the table's ps (a Keras 3 Embedding too: chief/contract/keras3_lookup.py)."""
    import tensorflow as tf

    size = int(variable.shape.num_elements() or 0) * variable.dtype.size
    rows = int(variable.shape[0]) if variable.shape.rank else 1
    if isinstance(gradient, tf.IndexedSlices):
        touched = len(np.unique(gradient.indices.numpy()))
        moved = touched * (size // max(1, rows)) + 8 * touched
        return {"name": variable.name, "bytes": size, "rows": rows, "pull_bytes": moved, "push_bytes": moved, "row_sparse": True}
    return {"name": variable.name, "bytes": size, "rows": rows, "pull_bytes": size, "push_bytes": size, "row_sparse": False}


def sample_features(job: Any, n: int) -> Any:
    """`n` examples' features from the job's training data, whichever source it defines."""
    import tensorflow as tf

    from chief.contract.arrays import rows

    if job.train_dataset is not None:
        features = next(iter(job.train_dataset().batch(n).take(1)))[0]
        return features
    if job.train_data is not None:
        features = job.train_data()[0]
    else:
        paths = job.train_arrays()[0]
        features = tf.nest.map_structure(lambda p: np.load(p, mmap_mode="r"), paths)
    count = len(tf.nest.flatten(features)[0])
    positions = np.sort(np.random.default_rng(0).choice(count, size=min(n, count), replace=False))
    return tf.nest.map_structure(np.asarray, rows(features, positions))


def main(argv: list[str]) -> int:
    """`python -m chief.variable_bytes JOB EXAMPLES_PER_WORKER`: the JSON object on stdout; a bad job: one
    line on stderr and exit code 2."""
    from cluster.errors import PstrainError, report

    try:
        print(json.dumps(job_summary(argv[0], int(argv[1]))))
    except PstrainError as e:
        return report(e)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
