"""The hybrid step's watchdog (chief/step/hybrid.py): an allreduce run whose chief stops ticking ends with
exit 75 (the launcher restarts every worker, then the chief), never hangs."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.cluster

HELD = """
import time
from chief.step.hybrid import Watchdog
watchdog = Watchdog(limit_s={limit})
watchdog.armed = {armed}
print("held at", time.monotonic(), flush=True)  # after the imports, which a loaded machine slows
time.sleep(8)  # the chief held, not ticking
print("still running")
"""


@pytest.mark.parametrize("armed", [True, False], ids=["armed", "disarmed"])
def test_an_armed_watchdog_ends_a_held_chief_restartably_in_one_line_and_a_disarmed_one_does_not(armed):
    code = HELD.format(limit=2.0, armed=armed)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    held = float(re.search(r"^held at ([\d.]+)$", result.stdout, re.M)[1])  # CLOCK_MONOTONIC: one clock for all processes
    elapsed = time.monotonic() - held  # from the hold to the end, not counting the child's imports
    if armed:
        assert result.returncode == 75 and "still running" not in result.stdout  # the launcher restarts the workers
        lines = [line for line in result.stderr.splitlines() if line.startswith("pstrain: ")]
        assert len(lines) == 1 and 'warning: train.dense = "allreduce": no progress for 2s' in lines[0], result.stderr
        assert elapsed < 8, elapsed
    else:
        assert result.returncode == 0 and "still running" in result.stdout, result.stderr
