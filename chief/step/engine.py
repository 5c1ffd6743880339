"""The Engine contract: how the training loop drives one way of running synchronous steps.

Two engines fulfil it: the cluster's (chief/step/dispatch.py) and this process's, the reference
(chief/step/local.py). Both take the same (step, slot) data, start from the same weights (the seed's,
each computed where its variable lives: chief/state/initial_values.py) and average the same per-slot
gradients, so a cluster run and a standalone run end with the same model. This module holds the
protocol, its `StepResult`, and what both engines build the same way: the inspected replica, the
positions of a slot's examples, step 0's first batch and the names of the averaged values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from chief.contract.framework import trainable_of
from chief.contract.job import Job
from chief.state.model_state import ModelState
from chief.step.positions import slot_indices
from cluster.config import TrainConfig
from worker.input.sources import Source
from worker.replica.gradients import sparse_variables
from worker.replica.replica import Replica, assigned_state_variables, inspect_job


@dataclass
class StepResult:
    loss: float  # the mean of the applied slots' losses
    aggregated: int  # gradients averaged into this step
    stale_dropped: int  # gradients computed for an earlier step but pushed after it was applied (backup replicas)
    workers: list[int] = field(default_factory=list)  # workers whose gradients were applied
    timing: dict[str, float] = field(default_factory=dict)  # seconds per phase of the step's block
    applied: bool = True  # False: a value was not finite, the update was withheld (see `nonfinite`)
    nonfinite: str | None = None  # the first of "loss" and the variables whose mean was not finite
    read_ahead: int | None = None  # applied gradients whose examples were read ahead (None: no read-ahead)
    epoch: int | None = None  # a stream's epoch at the step's first batch (None: read by position)
    reread: int | None = None  # a stream's applied batches read from a fresh pipeline (their worker was past them)


class Engine(Protocol):
    """How the training loop drives one way of running synchronous steps.

    Calls go in this order: construct -> `prepare(first_step)` once -> `run(first, count)` for
    consecutive blocks of steps -> `close()` once. `state` (model, optimizer, global step) exists from
    construction on, so a checkpoint can be restored into it before `prepare`.

    `run(first, count)` returns one result per step it got to, in order. Each applied step was
    applied exactly once from `replicas_to_aggregate` gradients. A step whose loss, mean gradient or
    mean state delta was not finite is withheld (`applied=False`, no variable changed): with
    `on_nonfinite = "stop"` it is the last result; with "skip" the block goes on past it. Fewer
    results than `count` without a withheld step means `interrupted()` turned true: the steps not
    returned were not applied, so a checkpoint taken then resumes exactly. After an exception the
    engine is unusable: the caller reports the error and exits, and a restarted chief resumes from
    the latest checkpoint.
    """

    state: ModelState

    def prepare(self, first_step: int) -> None:
        """Set up what depends on where the run starts (accumulators at `first_step`, per-worker data)."""

    def run(self, first: int, count: int, interrupted: Callable[[], bool] = lambda: False) -> list[StepResult]:
        """Run steps first..first+count-1. `interrupted` is polled while the steps run; when it turns
        true the engine stops at the next step boundary. An engine that never waits may ignore it."""

    def close(self) -> int:
        """End the run; returns how many more late (backup) gradients were dropped since the last step."""


def first_nonfinite(finite: Sequence[bool], names: Sequence[str]) -> str | None:
    """The name of the first value that was not finite (`finite` and `names` in the same order), or None."""
    return next((name for ok, name in zip(finite, names, strict=True) if not ok), None)


def value_names(replica: Replica) -> list[str]:
    """What a step averages, in order: the loss, each trainable variable, each state variable."""
    variables = [*trainable_of(replica.model), *replica.state_variables]
    return ["loss", *(v.name.split(":")[0] for v in variables)]


def inspected_replica(job: Job, state, train: TrainConfig, source: Source, sample_features) -> Replica:
    """The per-slot computation over this engine's model, once `inspect_job` accepts the job: row-sparse
    variables found by tracing the model on `sample_features`, state variables by the inspection."""
    sparse = tuple(sparse_variables(state.model, sample_features))
    found = inspect_job(job, train, first_batch(source, train), state.model, sparse)  # refuses a job that breaks the contract
    state_vars = assigned_state_variables(state.model, *found)
    return Replica(job, state.model, state.optimizer, state_vars, train.seed, train.replicas_to_aggregate, sparse)


def slot_positions(train: TrainConfig, num_examples: int, step: int, slot: int):
    """The positions of the examples behind gradient `slot` of `step` (chief/step/positions.py)."""
    t = train
    return slot_indices(num_examples, t.seed, step, slot, t.slot_batch_size, t.total_num_replicas, t.shuffle)


def first_batch(source: Source, train: TrainConfig):
    """Step 0's first slot, read locally: what `inspect_job` checks the job on before training."""
    if source.streams:
        return source.first_batch()
    return source.read_local(slot_positions(train, source.num_examples, 0, 0))
