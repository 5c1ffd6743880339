"""The console rule (cluster/launch/console.py) and the progress line (chief/metrics.py Progress)."""

from __future__ import annotations

import io

import pytest

from chief.metrics import Progress, format_eta
from cluster.launch.console import ConsoleFilter, for_console

pytestmark = pytest.mark.pure

TF_NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796290312.612434   11692 port.cc:153] oneDNN custom operations are on. You may see slightly different",
    "E0000 00:00:1796290312.7 11692 cuda_executor.cc:1309] failed call to cuInit: INTERNAL: CUDA error: UNKNOWN ERROR (303)",
    "W0000 00:00:1796290312.8 11692 gpu_device.cc:2365] Cannot dlopen some GPU libraries.",
    "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow with the appropriate flags.",
    "/usr/lib/python3/site-packages/tf_keras/src/engine.py:12: UserWarning: `build()` was called on layer",
    "  warnings.warn(",
    "2026-12-03 09:31:59,850 pstrain.chief placement: ps:0 8 variables 0.6 MiB; split across ps: none",
    "Traceback (most recent call last):",
    "hello from the job",
]
PSTRAIN_LINES = [
    "pstrain: cluster run of chief.jobs.digits, steps 0..20, global batch 64 = 2 x 32",
    "pstrain: error: step 3: loss is nan; stopped without applying it",
    "step 5/20  loss 2.2151  aggregated 2  2,951 examples/s  9.1 steps/s  ETA 0:02",
    "[###...............] step 5/20  loss 2.2151  aggregated 2  2,951 examples/s  9.1 steps/s  ETA 0:02",
]


@pytest.mark.parametrize("line", TF_NOISE)
def test_tensorflow_and_other_output_stays_in_the_log(line):
    assert not for_console(line)


@pytest.mark.parametrize("line", PSTRAIN_LINES)
def test_pstrain_lines_reach_the_console(line):
    assert for_console(line)


def test_filter_keeps_bar_redraws_and_drops_noise_across_chunk_boundaries():
    stream = (
        b"I0000 00:00:1.0 1 port.cc:153] oneDNN custom operations are on.\n"
        b"pstrain: cluster run of job, steps 0..2\n"
        b"\r[###...] step 1/2  loss 1.0\x1b[K\r[######] step 2/2  loss 0.5\x1b[K"
        b"resource: (_Arg): /job:chief/replica:0/task:0/device:CPU:0\n"  # TF's stderr, right after a redraw
        b"\n"
        b"W0000 00:00:2.0 1 x.cc:1] noise\n"
        b"pstrain: done in 1.0s\n"
    )
    expected = (
        b"pstrain: cluster run of job, steps 0..2\n"
        b"\r[###...] step 1/2  loss 1.0\x1b[K\r[######] step 2/2  loss 0.5\x1b[K"
        b"\n"
        b"pstrain: done in 1.0s\n"
    )
    for size in (1, 7, len(stream)):
        console = ConsoleFilter()
        shown = b"".join(console.feed(stream[i : i + size]) for i in range(0, len(stream), size))
        assert shown == expected, size


def test_a_bar_is_shown_as_soon_as_it_arrives():
    console = ConsoleFilter()
    assert console.feed(b"\r[#..] step 1/3  loss 1.0") == b""  # not complete yet
    assert console.feed(b"\x1b[K") == b"\r[#..] step 1/3  loss 1.0\x1b[K"
    assert console.feed(b"\n") == b"\n"  # ends the bar's line
    assert console.feed(b"\n") == b""  # a blank line elsewhere is noise


def test_progress_lines_carry_rate_and_eta():
    out = io.StringIO()
    progress = Progress(total=40, start=0, tty=False, out=out)
    for step in range(4):
        progress.update(step, 1.0, 640.0, 2, seconds=5.0 if step == 0 else 1.0)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/40 ") and "ETA" not in lines[0]  # the first step (tracing) is no rate
    assert lines[-1] == "step 4/40  loss 1.0000  aggregated 2  640 examples/s  1.0 steps/s  ETA 0:36"


def test_a_block_reported_at_once_shows_its_steps_rate():
    """A block's 64 lines are written within a millisecond: the rate is its steps' time, not the clock's."""
    out = io.StringIO()
    progress = Progress(total=200, start=0, tty=False, out=out)
    progress.update(0, 1.0, 100.0, 2, seconds=0.8)
    for step in range(1, 65):
        progress.update(step, 1.0, 12800.0, 2, seconds=0.01)
    assert out.getvalue().splitlines()[-1].endswith("12,800 examples/s  100.0 steps/s  ETA 0:01")


def test_tty_bar_redraws_one_line():
    out = io.StringIO()
    progress = Progress(total=2, start=0, tty=True, out=out)
    progress.update(0, 1.0, 100.0, 2, seconds=0.5)
    progress.update(1, 0.5, 100.0, 2, seconds=0.5)
    text = out.getvalue()
    assert text.startswith("\r[") and text.count("\r[") == 2 and text.endswith("ETA 0:00\x1b[K\n")
    assert all(for_console(part) for part in text.strip("\n").split("\r") if part)


@pytest.mark.parametrize(("seconds", "text"), [(0, "0:00"), (61.4, "1:01"), (3725, "1:02:05")])
def test_format_eta(seconds, text):
    assert format_eta(seconds) == text
