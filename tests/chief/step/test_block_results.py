"""The cluster engine's pure decisions (chief/step/block_results.py), without a process or a server: a block's
packed results decoded into StepResults (workers, late gradients, withheld steps, read-ahead hits, a
stream's epochs learnt step by step; a lean block's closures, which decide every step themselves) and
when a block whose global step does not move is ended. Pure."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from chief.step.block_results import (
    STALL_MIN_S,
    STALL_STEPS,
    apply_widths,
    block_results,
    lean_applied,
    stall_decision,
    unpack_applied,
)
from worker.input.sources import DataError
from worker.input.streams import StreamSource

pytestmark = pytest.mark.pure

NAMES = ["loss", "dense/kernel", "dense/bias"]
TIMING = {"dispatch": 0.25, "steps": 1.5}


def applied(rows: list[list]) -> tuple[np.ndarray, ...]:
    """The apply's packed rows for 3 slots and NAMES, decoded as the dispatch decodes them."""
    return unpack_applied(np.array(rows, np.float64), apply_widths(3, len(NAMES)))


def closure(worker: int, *per_step: list[int]) -> np.ndarray:
    """A worker loop's packed result: the worker, then [j, epoch, index, hit] per step."""
    return np.array([worker, *(v for row in per_step for v in row)], np.int64)


def test_each_proceeded_step_becomes_one_result_with_its_workers_and_late_gradients():
    # Step 0: slots 0 and 2 chosen, the apply knew slot 2's worker (7), slot 0's from its closure (4);
    # step 1: a non-finite bias, withheld; step 2: interrupted before its update, not a result.
    rows = [
        [0.5, True, False, True, -1, -1, 7, 1, True, True, True, True],
        [np.inf, False, True, True, -1, 5, 7, 0, True, True, False, True],
        [0.0, False, False, False, -1, -1, -1, 0, True, True, True, False],
    ]
    closures = {0: closure(4, [0, -1, -1, 1], [1, -1, -1, 0]), 1: closure(5, [0, -1, -1, 0], [1, -1, -1, 1])}
    steps = block_results(applied(rows), closures, 10, NAMES, None, True, TIMING)
    assert len(steps) == 2
    first, second = steps
    assert (first.loss, first.aggregated, first.stale_dropped, first.workers) == (0.5, 2, 1, [4, 7])
    assert first.applied and first.nonfinite is None and first.read_ahead == 1  # slot 0's hit; slot 2 sent no rows
    assert np.isinf(second.loss) and not second.applied and second.nonfinite == "dense/bias"
    assert second.workers == [5, 7] and second.read_ahead == 1  # slot 1's hit at step 1
    assert first.epoch is None and first.reread is None  # read by position
    assert first.timing == TIMING and first.timing is not second.timing
    assert block_results(applied(rows), closures, 10, NAMES, None, False, TIMING)[0].read_ahead is None


def test_a_slot_whose_worker_nobody_knows_is_left_out():
    rows = [[1.0, True, True, False, -1, -1, -1, 0, True, True, True, True]]
    steps = block_results(applied(rows), {1: closure(3, [0, -1, -1, 0])}, 0, NAMES, None, False, TIMING)
    assert steps[0].workers == [3] and steps[0].aggregated == 2


def test_a_stream_learns_its_epoch_length_from_the_step_it_is_seen_in():
    """Each step's batches are observed before its epoch is asked: a step before the first epoch's end
    is in epoch 0, the step whose batch shows epoch 1 already reports it."""
    source = StreamSource(lambda: tf.data.Dataset.range(64).map(lambda i: (i, i)), "train_dataset()", None, 4, 3)
    rows = [[1.0, True, True, True, -1, -1, -1, 0, True, True, True, True]] * 2
    # 3 slots, epochs of 4 batches: step 1's batches are 3, 4 and 5 (4 and 5 in epoch 1).
    closures = {s: closure(s, [s, 0, s, 0], [3 + s, (3 + s) // 4, (3 + s) % 4, s % 2]) for s in range(3)}
    steps = block_results(applied(rows), closures, 0, NAMES, source, False, TIMING)
    assert source.batches_per_epoch == 4
    assert [(r.epoch, r.reread) for r in steps] == [(0, 0), (0, 1)]  # step 1 starts at batch 3: epoch 0
    step_2 = {s: closure(s, [6 + s, 1, 2 + s, 0]) for s in range(3)}
    later = block_results(applied(rows[:1]), step_2, 2, NAMES, source, False, TIMING)
    assert later[0].epoch == 1  # step 2 starts at batch 6
    with pytest.raises(DataError, match="stream batch 9 is batch 3 of epoch 1"):
        block_results(applied(rows[:1]), {0: closure(0, [9, 1, 3, 0])}, 3, NAMES, source, False, TIMING)


def test_a_block_stalls_only_when_its_global_step_has_not_moved_for_long_enough():
    assert stall_decision(8, (7, 100.0), 500.0, 1.0) == ((8, 500.0), False)  # moved: progress restarts now
    assert stall_decision(7, (7, 100.0), 100.0 + STALL_MIN_S, 0.01) == ((7, 100.0), False)
    assert stall_decision(7, (7, 100.0), 100.0 + STALL_MIN_S + 0.1, 0.01) == ((7, 100.0), True)
    slow = 1.0  # slow steps get STALL_STEPS of them
    assert stall_decision(7, (7, 0.0), STALL_STEPS * slow, slow) == ((7, 0.0), False)
    assert stall_decision(7, (7, 0.0), STALL_STEPS * slow + 0.1, slow)[1]


def test_the_apply_result_packed_as_float64_unpacks_to_every_value_exactly():
    loss = np.float32(0.1)
    rows = [
        [loss, True, False, True, 4, -1, 7, 3, True, False, True, False],
        [np.float32(np.inf), False, True, True, -1, 2**40, 1, 0, False, True, True, True],
    ]
    losses, chosen, workers, late, finite, proceeded = unpack_applied(np.array(rows, np.float64), apply_widths(3, 3))
    assert losses.dtype == np.float32 and losses[0] == loss and np.isinf(losses[1])
    assert chosen.tolist() == [[True, False, True], [False, True, True]]
    assert workers.tolist() == [[4, -1, 7], [-1, 2**40, 1]] and late.tolist() == [3, 0]
    assert finite.tolist() == [[True, False, True], [False, True, True]] and proceeded.tolist() == [False, True]
    assert unpack_applied(np.zeros([0, sum(apply_widths(2, 5))]), apply_widths(2, 5))[1].shape == (0, 2)


def lean_closure(worker: int, *per_step: tuple[float, bool, bool]) -> np.ndarray:
    """A lean loop's packed result: the worker, then [j, epoch, index, hit, loss bits, finite, stopped] per step."""
    rows = [[-1, -1, -1, 0, int(np.float32(loss).view(np.int32)), finite, stopped] for loss, finite, stopped in per_step]
    return np.array([worker, *(v for row in rows for v in row)], np.int64)


def test_a_lean_block_gives_a_result_per_step_the_workers_took_and_withholds_a_non_finite_one():
    # Both slots ran 3 steps: two applied, the third's means not finite (the workers stopped there).
    steps = [(0.5, True, False), (0.25, True, False), (float("nan"), False, False)]
    found, closures = lean_applied({0: lean_closure(4, *steps), 1: lean_closure(7, *steps)}, 64, 7, 2)
    results = block_results(found, closures, 10, ["loss"], None, False, TIMING)
    assert [r.loss for r in results[:2]] == [0.5, 0.25] and np.isnan(results[2].loss)
    assert [r.applied for r in results] == [True, True, False] and results[2].nonfinite == "loss"
    assert all(r.aggregated == 2 and r.workers == [4, 7] and r.stale_dropped == 0 for r in results)


def test_a_lean_step_that_saw_the_stop_is_no_result():
    steps = [(0.5, True, False), (0.75, True, True)]
    found, closures = lean_applied({0: lean_closure(0, *steps), 1: lean_closure(1, *steps)}, 64, 7, 2)
    results = block_results(found, closures, 0, ["loss"], None, False, TIMING)
    assert [(r.loss, r.applied) for r in results] == [(0.5, True)]


def test_lean_closures_that_disagree_are_an_error_not_a_result():
    one, other = lean_closure(0, (0.5, True, False)), lean_closure(1, (0.5, True, True))
    with pytest.raises(RuntimeError, match="disagree"):
        lean_applied({0: one, 1: other}, 64, 7, 2)
    with pytest.raises(RuntimeError, match="disagree"):
        lean_applied({0: one}, 64, 7, 2)  # a slot missing
