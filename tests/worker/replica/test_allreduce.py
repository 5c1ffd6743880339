"""The hybrid step's exchange (worker/replica/allreduce.py) among real TF workers: the slot-order mean, by
the gather (3 workers) and by the all-reduce's sum (2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.cluster


def exchange(workers: int) -> dict:
    argv = [sys.executable, "-m", "tests.worker.replica.exchange_probe", str(workers)]
    probe = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert probe.returncode == 0, probe.stderr[-3000:]
    return json.loads(probe.stdout.strip().splitlines()[-1])


def test_three_workers_get_the_slot_order_mean_whatever_their_ranks():
    """Slots assigned against the ranks (slot = (rank + 1) % 3), on gradients whose sum in rank order
    rounds differently: every worker gets exactly add_n in slot order / 3, as the ps and standalone."""
    found = exchange(3)
    assert sorted(found["ranks_slots"]) == [[0.0, 1.0], [1.0, 2.0], [2.0, 0.0]]
    assert found["rank_order_differs"], "the inputs must make the order of addition visible"
    assert found["equal_to_slot_order"] == [True, True, True]


def test_two_workers_sum_to_the_slot_order_mean():
    """Two workers take the all-reduce's sum (one addition per value, which commutes), then / 2: each
    gets exactly the standalone engine's add_n in slot order / 2, slots against the ranks, on values
    most of whose sums round (a sum in another precision or rounding would differ)."""
    found = exchange(2)
    assert sorted(found["ranks_slots"]) == sorted([[0.0, 1.0], [1.0, 0.0]] * 2)  # twice: the same keys, one step after another
    assert found["sums_rounded"] > 1000, found
    assert found["equal_to_slot_order"] == [True] * 4
    assert found["large_only_equal"] == [True, True]  # two collectives of their own, none packed
