"""chief/blocks.py: block_length, how many steps the chief dispatches at once."""

from __future__ import annotations

import pytest

from chief.blocks import BLOCK_SECONDS, block_length
from cluster.config import TrainConfig

pytestmark = pytest.mark.pure


def blocks(train: TrainConfig, first: int = 0, step_seconds: float | None = None) -> list[int]:
    """The block lengths of a whole run from `first`, every block's steps taking `step_seconds`."""
    out, step = [], first
    while step < train.steps:
        out.append(block_length(step, train, first, step_seconds if step > first else None))
        step += out[-1]
    return out


def test_the_first_block_is_one_step_then_k_and_blocks_end_at_checkpoints_evaluations_and_the_end():
    train = TrainConfig(steps=300, steps_per_execution=64, checkpoint_every=100, eval_every=0)
    assert blocks(train) == [1, 64, 35, 64, 36, 64, 36]
    assert blocks(TrainConfig(steps=50, steps_per_execution=16, checkpoint_every=0, eval_every=20)) == [1, 16, 3, 16, 4, 10]
    assert blocks(train, first=250) == [1, 49]  # resumed: the first block is again one step


def test_slow_steps_cut_a_block_to_about_block_seconds():
    train = TrainConfig(steps=1000, steps_per_execution=64, checkpoint_every=0)
    assert blocks(train, step_seconds=0.01)[1] == 64  # 0.64 s: K decides
    assert blocks(train, step_seconds=0.1)[1] == int(BLOCK_SECONDS / 0.1) == 20
    assert set(blocks(train, step_seconds=5.0)) == {1}  # a step longer than BLOCK_SECONDS: one per dispatch
