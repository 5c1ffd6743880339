"""worker/start_turns.py: the servers beside the chief load TensorFlow in turns, all cores but one at a
time; a turn is released when its holder ends however it ends, nobody waits for one forever, and a
turn that cannot be had never stops a start. Only the launcher's servers take turns (TaskEnv)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from cluster.taskenv import START_TURNS_ENV, TaskEnv
from tests.helpers import ROOT
from worker.start_turns import start_turn, turn_count

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# A process that asks for a turn (of a 2-core machine's one), holds it for argv[2] seconds and says when
# (CLOCK_MONOTONIC: one clock for every process of the machine).
HOLDER = """
import json, sys, time
from pathlib import Path
from worker.start_turns import start_turn
directory, hold = Path(sys.argv[1]), float(sys.argv[2])
print(json.dumps({"asking": True}), flush=True)
with start_turn(cores=2, directory=directory, max_wait_s=60) as held:
    start = time.monotonic()
    print(json.dumps({"held": held}), flush=True)
    time.sleep(hold)
    end = time.monotonic()
print(json.dumps({"held": held, "start": start, "end": end}), flush=True)
"""


@pytest.mark.pure
def test_all_cores_but_the_chiefs_load_at_once_and_at_least_one():
    assert [turn_count(cores) for cores in (1, 2, 3, 16)] == [1, 1, 2, 15]


@pytest.mark.pure
def test_only_servers_the_launcher_marks_take_turns():
    assert TaskEnv(start_turns=True).to_env() == {START_TURNS_ENV: "1"}
    assert TaskEnv.from_env({START_TURNS_ENV: "1"}).start_turns
    assert not TaskEnv.from_env({}).start_turns and START_TURNS_ENV not in TaskEnv().to_env()


@pytest.mark.pure
def test_a_turn_is_exclusive_and_the_wait_for_one_is_bounded(tmp_path):
    with start_turn(cores=2, directory=tmp_path) as held:
        assert held
        waited = time.monotonic()
        with start_turn(cores=2, directory=tmp_path, max_wait_s=0.2) as second:
            assert not second  # the one turn is taken: after 0.2 s the block runs without one
        assert 0.2 <= time.monotonic() - waited < 2
        with start_turn(cores=3, directory=tmp_path, max_wait_s=0) as other:
            assert other  # 3 cores: two turns, the second free
    with start_turn(cores=2, directory=tmp_path, max_wait_s=0) as again:
        assert again  # released at the block's end


@pytest.mark.pure
def test_turn_files_that_cannot_be_made_or_trusted_never_stop_a_start(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with start_turn(cores=2, directory=blocked / "turns", max_wait_s=0) as held:
        assert not held  # the folder cannot be made
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with start_turn(cores=2, directory=tmp_path / "link", max_wait_s=0) as held:
        assert not held  # a link planted where the folder should be is not followed
    assert not list((tmp_path / "real").iterdir())
    (tmp_path / "turns").mkdir()
    (tmp_path / "turns" / "turn-0").symlink_to(tmp_path / "real" / "planted")
    with start_turn(cores=2, directory=tmp_path / "turns", max_wait_s=0) as held:
        assert not held  # nor a link planted as a turn file
    assert not (tmp_path / "real" / "planted").exists()


@pytest.mark.cluster
def test_processes_take_the_turn_one_at_a_time_and_a_killed_holder_releases_it(tmp_path):
    killed = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "60"], env=ENV, stdout=subprocess.PIPE, text=True)
    others: list[subprocess.Popen] = []
    try:
        assert json.loads(killed.stdout.readline()) == {"asking": True}
        assert json.loads(killed.stdout.readline()) == {"held": True}
        others = [
            subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "0.3"], env=ENV, stdout=subprocess.PIPE, text=True)
            for _ in range(3)
        ]
        for p in others:  # each has asked for the turn that the first holds
            assert json.loads(p.stdout.readline()) == {"asking": True}
        time.sleep(0.5)
        assert all(p.poll() is None for p in others)
        freed = time.monotonic()
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=10)
        spans = []
        for p in others:
            out, _ = p.communicate(timeout=30)
            lines = [json.loads(line) for line in out.splitlines()]
            assert p.returncode == 0 and lines[-1]["held"]
            spans.append((lines[-1]["start"], lines[-1]["end"]))
    finally:
        for p in [killed, *others]:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    spans.sort()
    assert spans[0][0] - freed < 15  # the kernel released the killed holder's lock (they would wait 60 s)
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end  # never two at once
    assert not psutil.Process().children(recursive=True)
