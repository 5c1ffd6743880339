"""`ps_applied` (worker/replica/allreduce.py): whether the ps applied a step, which a worker's copies must
follow, from what the step gate's wait returned and the global step."""

from __future__ import annotations

import pytest
import tensorflow as tf

from worker.ps.gate import ABORT
from worker.replica.allreduce import ps_applied

pytestmark = pytest.mark.pure

STEP = 27


def applied(token: int, global_step: int) -> bool:
    step = tf.Variable(tf.constant(global_step, tf.int64))
    return bool(ps_applied(tf.constant(token, tf.int64), step, tf.constant(STEP, tf.int64)))


def test_the_next_steps_token_means_applied_and_the_global_step_is_not_needed():
    assert applied(STEP + 1, global_step=STEP)  # read before the apply moved it: the token decides


def test_an_abort_seen_after_the_step_was_applied_still_means_applied():
    """The queue held step 28's token, then the abort of step 28; another waiter's peek put 28 back
    behind the abort, so this one saw the abort first. The global step (28) says step 27 was applied."""
    assert applied(ABORT, global_step=STEP + 1)


def test_an_abort_of_the_step_itself_means_not_applied():
    assert not applied(ABORT, global_step=STEP)
