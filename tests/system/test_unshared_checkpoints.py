"""A ps that cannot reach the checkpoint directory, for real: two hosts (network namespaces,
tests/netns.py), the chief and both workers on A (`pstrain launch`), the ps on B (`pstrain node`) in a
mount namespace of its own where a private tmpfs covers RUN_DIR, as on a second machine without the
shared mount. The chief's reach check (chief/state/route.py) then finds the ps's probe file missing:
a model that fits the chief is checkpointed from the chief's full copy, with a log line, and ends
with the standalone model; one larger than the chief's memory (a cgroup limit) is refused before the
first step, in one line."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import pytest

from tests import memlimit
from tests.helpers import (
    PSTRAIN,
    ROOT,
    Result,
    alive,
    assert_no_orphans,
    descendant_pids,
    metrics,
    run_pstrain,
    task_pid,
    with_session_flags,
)
from tests.netns import netns_tier, two_hosts
from tests.soak import compare_checkpoints
from tests.system.two_hosts import node_argv, write_two_host_job

pytestmark = netns_tier()

# `ip netns exec` mounts a sysfs of its own at /sys, without the cgroup file systems a machine has there:
# mounted again on host A (in its own mount namespace) so that the chief reads its memory limit.
CGROUPS = (
    "mount -t tmpfs cgroups /sys/fs/cgroup && mkdir /sys/fs/cgroup/memory"
    " && mount -t cgroup -o memory memory /sys/fs/cgroup/memory"
)
FALLBACK = "checkpoints: ps:0 cannot write to {} (no shared mount?): the chief writes them from a full copy of the state"


def run_without_a_shared_mount(tmp_path: Path, tag: int, extra: list[str], during=None, cgroups=False) -> tuple[Result, str]:
    """`pstrain launch --config … EXTRA` on host A (with the memory cgroups mounted there, `cgroups`) and
    `pstrain node` (the ps) on host B, B seeing a tmpfs of its own at RUN_DIR; `during(launcher_pid)` runs
    while they do. Returns (the launcher's result, the node's output); everything is reaped, and nothing
    is left running."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # the mount point, on A's file system: B's ps sees an empty tmpfs there
    outputs = [tmp_path / "launch.out", tmp_path / "node.out"]
    with two_hosts(tag=tag) as (a, b):
        hosts = {"a": a, "b": b}  # the ps alone on B; both workers on A
        config, token = write_two_host_job(tmp_path, hosts, ps="b", workers="aa", steps=40, checkpoint_every=20, run_dir=run_dir)
        node = PSTRAIN + node_argv(a, token, tmp_path / "node")
        private = f'mount -t tmpfs pstrain-test "{run_dir}" && exec "$0" "$@"'
        launch = PSTRAIN + with_session_flags(["launch", "--config", str(config), *extra])
        argvs = [
            a.command(["sh", "-c", CGROUPS + ' && exec "$0" "$@"', *launch] if cgroups else launch),
            b.command(["unshare", "--mount", "--propagation", "private", "sh", "-c", private, *node]),
        ]
        processes = [
            subprocess.Popen(argv, cwd=ROOT, stdout=open(out, "w"), stderr=subprocess.STDOUT)
            for argv, out in zip(argvs, outputs, strict=True)
        ]
        launcher, node_process = processes
        seen: set[int] = set()
        try:
            deadline = time.monotonic() + 300
            while launcher.poll() is None and time.monotonic() < deadline:
                seen |= descendant_pids(p.pid for p in processes)
                if during:
                    during(launcher.pid)
                time.sleep(0.1)
            node_process.wait(timeout=60)
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for left in alive(seen):
                left.kill()
    result = Result(launcher.returncode, outputs[0].read_text(), seen)
    assert_no_orphans(result)
    return result, outputs[1].read_text()


def test_a_ps_without_the_run_dir_checkpoints_through_the_chief_and_ends_as_standalone(tmp_path):
    """The digits model (fits the chief): the chief logs that ps:0 cannot write to RUN_DIR/checkpoints and
    that it writes them from a full copy; the run ends, exit 0, with the standalone run's checkpoint bit
    for bit. The ps wrote nothing into A's RUN_DIR (its probe went to its own tmpfs)."""
    run, node_output = run_without_a_shared_mount(tmp_path, tag=3, extra=[])
    assert run.returncode == 0, run.output + node_output
    chief_log = (tmp_path / "run" / "logs" / "chief-0.log").read_text()
    assert FALLBACK.format(tmp_path / "run" / "checkpoints") in chief_log, chief_log
    print(next(line for line in chief_log.splitlines() if "cannot write to" in line))
    assert [r["step"] for r in metrics(tmp_path / "run")[0]] == list(range(40))
    assert not list((tmp_path / "run" / "checkpoints").glob(".ps-can-write*")), "no probe file left"
    reference = tmp_path / "standalone"
    standalone = run_pstrain(["train", "--standalone", "--run-dir", str(reference), "--steps", "40"])
    assert standalone.returncode == 0, standalone.output
    largest, different = compare_checkpoints(tmp_path / "run", reference)
    assert different == [], f"differs from the standalone run in {different} (largest {largest})"


CHIEF_LIMIT_MIB = 448  # above the chief's own charge (about 300 MiB), below the 488 MiB table


def test_a_ps_without_the_run_dir_and_a_model_larger_than_the_chief_is_refused_in_one_line(tmp_path):
    """A 488 MiB table (tests/jobs/tables.py's `big`) on the ps of host B, the chief in a cgroup limited to
    448 MiB: refused before the first step with one line naming the ps, the directory, both sizes and
    what to share; exit 1, no step run, no traceback, nothing left running. Where no cgroup can be
    made here, the test is skipped (the refusal's decision is unit-tested in test_checkpoint_route.py)."""
    limit = memlimit.make(CHIEF_LIMIT_MIB * 2**20)
    if limit is None:
        pytest.skip("no memory cgroup can be made here: the chief's memory cannot be limited")

    def limit_the_chief(launcher_pid: int) -> None:
        pid = task_pid(launcher_pid, "chief", 0)
        if pid:
            with contextlib.suppress(ProcessLookupError, OSError):
                limit.admit(pid)

    try:
        extra = ["--job", "tests.jobs.tables:big", "--global-batch-size", "32"]
        run, node_output = run_without_a_shared_mount(tmp_path, tag=4, extra=extra, during=limit_the_chief, cgroups=True)
        admitted, oom_kills = bool(limit.admitted), limit.oom_kills()
    finally:
        limit.remove()
    assert admitted and oom_kills == 0, (admitted, oom_kills)
    checkpoints = tmp_path / "run" / "checkpoints"
    said = [line for line in run.output.splitlines() if line.startswith("pstrain: error:")]
    assert len(said) == 1, run.output
    refusal = f"pstrain: error: ps:0 cannot write to {checkpoints}, and the model's state (0.48 GiB) is more than the chief"
    assert said[0].startswith(refusal), said
    print(said[0])
    assert f"share {tmp_path / 'run'} with every ps at the same path (a shared mount)" in said[0], said
    assert run.returncode == 1, run.output + node_output
    assert "Traceback" not in run.output
    assert metrics(tmp_path / "run")[0] == [], "no step ran"
