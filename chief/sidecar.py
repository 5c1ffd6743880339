"""`pstrain evaluate RUN_DIR`: a sidecar evaluator that follows a run's checkpoints, as TF's SidecarEvaluator does.

Each checkpoint that appears is restored into a local copy of the job's model and evaluated on the
job's eval set (chief/data/eval_set.py), read in batches from this machine's copy; one line per checkpoint
goes to RUN_DIR/eval.jsonl. It stops once the run's "done" line is in metrics.jsonl and the last
checkpoint is evaluated, or after `timeout_s`.
Nothing is written to the run's own files; checkpoints are only read.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf

from chief.contract.arrays import checked_arrays, rows
from chief.contract.job import load_job
from chief.data.eval_set import eval_set
from chief.data.train_source import train_source
from chief.scores import evaluate
from chief.state.adapted import check_adapted
from chief.state.model_state import finalize_layers
from cluster.errors import TrainingError
from cluster.rundir import RunDir


def checkpoints_to_evaluate(directory: Path, seen: set[int]) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints not evaluated yet, oldest first."""
    state = tf.train.get_checkpoint_state(str(directory))
    paths = list(state.all_model_checkpoint_paths) if state else []
    found = [(int(p.rsplit("-", 1)[-1]), p) for p in paths]
    return sorted((step, p) for step, p in found if step not in seen)


def follow(layout: RunDir, timeout_s: float, poll_s: float = 1.0, say: Callable[[str], None] = print) -> int:
    """Evaluate every new checkpoint of the run in `layout` until the run is done; returns the exit code."""
    deadline = time.monotonic() + timeout_s
    while not layout.config_record.exists():  # started beside a run that has not begun yet
        if time.monotonic() > deadline:
            from chief.contract.job import JobError

            raise JobError(f"evaluate: {layout.path} is not a pstrain run directory (no cluster.json); give the run's --run-dir")
        time.sleep(poll_s)
    train = layout.train()
    job = load_job(train.job)

    def first_training_examples(n: int):  # the eval set of a job without one
        if job.train_data:
            return rows(checked_arrays(job.spec, "train_data", job.train_data()), slice(0, n))
        source = train_source(job, layout.evaluator_copy)  # its own copy of train_data() arrays: not the workers'
        return source.first(n)

    data = eval_set(job, first_training_examples)
    sample = tf.nest.map_structure(np.asarray, next(data.batches(1))[0])
    model = job.model_fn()
    model(sample, training=False)
    if layout.adapted.exists():  # the run's adapted layers, or the checkpoints would be read with other ones
        check_adapted(model, layout.adapted, resumed=True)
    checkpoint = tf.train.Checkpoint(model=model)
    seen: set[int] = set()
    with open(layout.evaluations, "a", buffering=1) as out:
        while True:
            finished = layout.is_done()  # read before listing: a done run has written its last checkpoint
            for step, path in checkpoints_to_evaluate(layout.checkpoints, seen):
                try:
                    checkpoint.restore(path).expect_partial()
                except (tf.errors.NotFoundError, tf.errors.DataLossError):
                    continue  # rotated away (max_to_keep) between listing and reading
                finalize_layers(model)
                seen.add(step)
                scores = evaluate(job, model, data)
                out.write(json.dumps({"event": "eval", "step": step, **scores}) + "\n")
                say(f"pstrain: evaluated checkpoint {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
            if finished:
                return 0
            if time.monotonic() > deadline:
                raise TrainingError(
                    f"evaluate: {layout.path} has no done line after {timeout_s:g}s ({len(seen)} checkpoints evaluated); "
                    "raise --timeout for a longer run"
                )
            time.sleep(poll_s)
