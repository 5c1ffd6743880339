"""Read-ahead of the next step's examples (worker/input/readahead.py): the protocol in one process.

The cluster runs that use it (train_dataset() jobs) are checked against the standalone run in
tests/system/test_worker_data.py; here, without a cluster: a closure's put-then-take order never waits on
itself, a request is read in the background before it is taken, and a miss reads the examples anew.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import tensorflow as tf

from worker.input.readahead import ReadAhead, request_tag, schedule_order

pytestmark = pytest.mark.pure


def test_slots_are_scheduled_in_the_order_the_previous_step_finished():
    assert schedule_order([], 3) == [0, 1, 2]
    assert schedule_order([2, 0, 1], 3) == [2, 0, 1]
    assert schedule_order([1], 3) == [1, 0, 2]  # a slot still running (a backup) goes after the finished ones
    assert schedule_order([1, 1, 5], 2) == [1, 0]  # repeats and slots of another topology are ignored


def test_tags_are_unique_per_step_and_slot():
    tags = {int(request_tag(tf.constant(step, tf.int64), slot, 3)) for step in range(4) for slot in range(3)}
    assert tags == set(range(12))


def test_a_request_is_read_ahead_and_taken_by_the_next_closure_of_its_slot():
    reads = tf.Variable(0, dtype=tf.int64)  # how many batches the pipeline has read

    def read(positions):
        with tf.control_dependencies([reads.assign_add(1)]):
            return positions * 10

    readahead = ReadAhead(batch_size=3, total_slots=2)
    iterator = iter(readahead.dataset(read))

    @tf.function
    def closure(step, slot, positions, next_positions):
        tag = request_tag(step, slot, 2)
        with tf.control_dependencies([readahead.request(tag + 2, next_positions)]):
            element = next(iterator)
        return readahead.take(element, tag, lambda: positions * 10 + 1)  # +1 marks a batch read anew

    steps = [np.array([1, 2, 3]), np.array([4, 5, 6]), np.array([7, 8, 9])]
    batch, hit = closure(tf.constant(0, tf.int64), 0, steps[0], steps[1])
    assert not hit and batch.numpy().tolist() == [11, 21, 31]  # the first closure finds the placeholder
    batch, hit = closure(tf.constant(1, tf.int64), 0, steps[1], steps[2])
    assert hit and batch.numpy().tolist() == [40, 50, 60]  # read ahead by the previous closure's request
    batch, hit = closure(tf.constant(2, tf.int64), 1, np.array([0, 0, 0]), steps[0])  # slot 1: not what was read
    assert not hit and batch.numpy().tolist() == [1, 1, 1]
    assert int(reads.numpy()) >= 3  # the placeholder and the two requests taken
    for _ in range(200):  # the third request is read in the background, before anyone takes it
        if int(reads.numpy()) == 4:
            break
        time.sleep(0.01)
    assert int(reads.numpy()) == 4
