"""What a user looks at during and after a run, from ONE short real cluster run (module fixture):
TensorBoard event files, `pstrain plot`, and the quiet console."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import statistics
import struct
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.chief.test_tensorboard import read_scalars
from tests.helpers import ROOT, Result, alive, assert_no_orphans, metrics, run_pstrain

pytestmark = pytest.mark.cluster

STEPS = 20
TF_LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]", re.M)  # absl/glog prefix


def run_on_terminal(argv: list[str], timeout: float = 300, env: dict | None = None) -> Result:
    """Run a command with a pseudo-terminal as its stdout/stderr, as a user's shell would; returns
    everything the terminal received (raw: \\r redraws kept) and every descendant pid seen."""
    controller, terminal = pty.openpty()
    environ = {**os.environ, **(env or {})}
    process = subprocess.Popen(argv, cwd=ROOT, env=environ, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    received, seen = b"", set()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                seen |= {p.pid for p in psutil.Process(process.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
            if select.select([controller], [], [], 0.1)[0]:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    chunk = b""
                if not chunk and process.poll() is not None:
                    break
                received += chunk
            elif process.poll() is not None:
                break
        else:
            for p in alive(seen | {process.pid}):
                p.kill()
            raise AssertionError(f"{argv} did not finish within {timeout}s:\n{received.decode(errors='replace')}")
    finally:
        os.close(controller)
    return Result(process.wait(), received.decode("utf-8", "replace"), seen)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """The README's command on a terminal: deploy/start_local.sh (environment already set up), with the
    device-placement log on (as deploy/gpu_check.sh runs it): more TensorFlow output to keep off the console."""
    run_dir = tmp_path_factory.mktemp("views") / "run"
    argv = [str(ROOT / "deploy" / "start_local.sh"), "--run-dir", str(run_dir), "--steps", str(STEPS), "--checkpoint-every", "10"]
    result = run_on_terminal(argv, env={"PSTRAIN_LOG_DEVICE_PLACEMENT": "1"})
    assert result.returncode == 0, result.output
    assert_no_orphans(result)
    return run_dir, result


def test_console_shows_pstrain_only_and_logs_keep_tensorflow_output(short_run):
    run_dir, result = short_run
    console = result.output
    assert not TF_LOG_LINE.search(console), console
    assert "oneDNN" not in console and "absl::InitializeLog" not in console and "/device:" not in console, console
    for name in ("chief-0", "ps-0", "worker-0", "worker-1"):
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert TF_LOG_LINE.search(log), f"{name}.log lacks TensorFlow's own lines"
    assert "placement:" in (run_dir / "logs" / "chief-0.log").read_text()
    lines = [line.removesuffix("\x1b[K") for line in re.split(r"[\r\n]+", console) if line.strip()]
    assert all(line.startswith(("pstrain", "[")) for line in lines), lines
    # A live bar on the terminal: redrawn with \r, with rate and ETA, and the last redraw shows the end.
    bars = [line for line in lines if line.startswith("[")]
    assert len(bars) >= STEPS // 2 and all(re.search(r"step \d+/20 .* steps/s  ETA \d+:\d\d$", b) for b in bars[1:]), bars
    assert bars[-1].startswith("[" + "#" * 30 + "] step 20/20") and "pstrain: done" in console


def test_tensorboard_events_of_a_cluster_run(short_run):
    run_dir, _ = short_run
    steps, done = metrics(run_dir)
    train = read_scalars(run_dir / "tensorboard" / "train")
    assert [s for s, _ in train["loss"]] == list(range(STEPS))
    assert [round(v, 5) for _, v in train["loss"]] == [round(r["loss"], 5) for r in steps]
    assert {round(v, 9) for _, v in train["learning_rate"]} == {0.001}  # the digits job's Adam(1e-3)
    for tag in ("seconds", "steps_per_second", "examples_per_second", "aggregated", "stale_dropped"):
        assert len(train[tag]) == STEPS, tag
    for phase in steps[0]["timing"]:
        assert len(train[f"timing/{phase}"]) == STEPS, phase
    counted = {w: sum(w in r["workers"] for r in steps) for w in (0, 1)}
    assert {w: train[f"gradients_applied/worker_{w}"][-1][1] for w in (0, 1)} == counted
    evals = read_scalars(run_dir / "tensorboard" / "eval")
    assert evals["accuracy"][0][0] == STEPS and round(evals["accuracy"][0][1], 5) == round(done["eval_accuracy"], 5)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_plot_command_writes_the_pngs_of_a_run(short_run):
    import matplotlib.image

    run_dir, _ = short_run
    result = run_pstrain(["plot", str(run_dir)], timeout=120)
    assert result.returncode == 0, result.output
    names = {"loss", "step_time", "examples_per_second", "gradients_per_worker"}
    assert {p.stem for p in (run_dir / "plots").glob("*.png")} == names
    for name in names:
        path = run_dir / "plots" / f"{name}.png"
        assert png_size(path) == (640, 360)
        pixels = matplotlib.image.imread(path)[..., :3]
        assert (pixels < 0.9).any(axis=-1).mean() > 0.02, f"{name}.png looks empty"
    # The stacked step-time plot shows one colour per phase (+ "other"): many distinct saturated colours.
    stacked = matplotlib.image.imread(run_dir / "plots" / "step_time.png")[..., :3]
    saturated = stacked[(stacked.max(axis=-1) - stacked.min(axis=-1)) > 0.3]
    assert len({tuple((c * 8).astype(int)) for c in saturated}) >= 4


def test_plot_of_a_missing_run_is_one_line(tmp_path):
    result = run_pstrain(["plot", str(tmp_path / "nothing")], timeout=60)
    assert (
        result.returncode == 2 and result.output.startswith("pstrain: error: pstrain plot:") and "Traceback" not in result.output
    )


def test_gpu_check_reads_where_each_worker_computed(short_run, tmp_path):
    """The placement log of a real run: on this CPU-only machine every worker computed on its CPU,
    and deploy/gpu_check.sh's report says so (and fails) rather than claim a GPU. Its throughput line
    sets the run against a one-process run, here one written with known step times."""
    from cluster.doctor.gpu_check import placements, report
    from cluster.rundir import RunDir

    run_dir, _ = short_run
    for index in (0, 1):
        devices = placements((run_dir / "logs" / f"worker-{index}.log").read_text())
        assert set(devices) == {index}
        assert list(devices[index]) == [f"/job:worker/replica:0/task:{index}/device:CPU:0"] and devices[index].total() >= 4
    # 64 examples a step; the first 3 steps (tracing) are slow and left out, the median of the rest is 0.5 s.
    one_process = tmp_path / "one_process"
    one_process.mkdir()
    (one_process / "cluster.json").write_text(json.dumps({"train": {"global_batch_size": 64}}))
    seconds = [5.0, 5.0, 5.0, 0.5, 0.25, 0.5, 1.0]
    (one_process / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": k, "seconds": s}) + "\n" for k, s in enumerate(seconds))
    )
    batch = json.loads((run_dir / "cluster.json").read_text())["train"]["global_batch_size"]
    pstrain = batch / statistics.median(step["seconds"] for step in metrics(run_dir)[0][3:])
    lines, on_gpu = report(RunDir(run_dir), RunDir(one_process), workers=2)
    assert not on_gpu
    for index in (0, 1):
        cpu = f"/job:worker/replica:0/task:{index}/device:CPU:0"
        assert re.fullmatch(rf"worker-{index}: compute ops placed on {cpu} \(\d+ ops\)  <- not a GPU", lines[index]), lines
    assert lines[2] == (
        f"throughput: pstrain {pstrain:,.0f} examples/s (2 workers), one process 128 examples/s, "
        f"pstrain / one process = {pstrain / 128:.2f}x"
    )
