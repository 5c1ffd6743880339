"""Shared fixtures, and the tier guard: every test carries exactly one tier marker (pytest.ini)."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from tests import helpers
from tests.proof import PROOF, unallowed_skips

TIERS = ("pure", "inprocess", "cluster", "netns")  # cheapest first, as deploy/run_tests.sh runs them


def pytest_addoption(parser):
    parser.addoption(
        "--steps-per-execution",
        type=int,
        default=None,
        help="run every `pstrain launch`/`train` the tests start through run_pstrain with this many steps per "
        "dispatch, unless the test sets its own (1: the chief on every step's path); default: the config's",
    )
    parser.addoption(
        "--dense",
        choices=("ps", "allreduce"),
        default=None,
        help="run every `pstrain launch`/`train` the tests start through run_pstrain with train.dense = MODE, unless "
        "the test sets its own (allreduce: the hybrid step; a run it refuses skips, naming why); default: the config's",
    )


def pytest_configure(config):
    helpers.STEPS_PER_EXECUTION = config.getoption("--steps-per-execution")
    helpers.DENSE = config.getoption("--dense")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Refuse the session when a test has no tier marker, more than one, or one that its fixtures belie."""
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid} has {' and '.join(tiers) or 'no tier marker'}")
        elif "in_process_cluster" in getattr(item, "fixturenames", ()) and tiers != ["inprocess"]:
            wrong.append(f"{item.nodeid} uses in_process_cluster but is marked {tiers[0]}")
    if wrong:
        raise pytest.UsageError(
            "each test needs exactly one tier marker of " + ", ".join(TIERS) + " (pytest.ini): " + "; ".join(wrong)
        )


_skipped: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_collectreport(report):
    """A module that skips as it is imported (pytest.importorskip, a module-level pytest.skip) reports
    its skip here, as its path, and never reaches pytest_runtest_logreport."""
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    """Under CI ($PSTRAIN_CI=1, set by .ci/run) a skipped test the docs cite as proof fails the run, unless
    $PSTRAIN_ALLOWED_SKIPS (comma-separated node ids or file paths) names it (tests/proof.py)."""
    if os.environ.get("PSTRAIN_CI") != "1":
        return
    bad = unallowed_skips(_skipped, os.environ.get("PSTRAIN_ALLOWED_SKIPS", ""), PROOF)
    if bad:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = "pstrain: error: proof tests skipped (name them in PSTRAIN_ALLOWED_SKIPS to allow): " + ", ".join(bad)
        if reporter:
            reporter.ensure_newline()
            reporter.write_line(line)
        else:
            print(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _no_process_in_cheap_tiers(request, monkeypatch):
    """A `pure` or `inprocess` test that starts a process fails, naming the tier it belongs to."""
    tier = next((name for name in ("pure", "inprocess") if request.node.get_closest_marker(name)), None)
    if tier is None:
        return

    def refuse(self, args, *rest, **kwargs):
        raise AssertionError(f"a {tier} test started a process ({args!r}); mark it cluster")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture(autouse=True)
def _gpu_or_skip(request):
    """A test marked `gpu` skips, saying why, on a machine where nvidia-smi lists no GPU."""
    if request.node.get_closest_marker("gpu") is None:
        return
    from cluster.launch.gpu_count import gpu_count

    if gpu_count() == 0:
        pytest.skip("needs an NVIDIA GPU: nvidia-smi lists none here (deploy/gpu_check.sh runs these where there is one)")


_given: set[int] = set()  # every port _free_port returned in this session


def _free_port() -> int:
    """A port free on 127.0.0.1 now and never returned before in this session (OSError when none is left).

    A port already handed out is kept bound while asking again, so the kernel must pick another.
    """
    held: list[socket.socket] = []
    try:
        while True:
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
    finally:
        for s in held:
            s.close()


@pytest.fixture(scope="session")
def in_process_cluster():
    """A resolver for 2 workers and 2 ps as real TF servers inside the test process (no subprocesses).

    In-process servers cannot be stopped; they live as long as the test process, as in TF's own
    tests. They share the process, so each gets a large inter-op pool: the ps kernels that wait for
    gradients would otherwise starve the 2-core default and hang the step.
    """
    import tensorflow as tf

    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)], "ps": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    spec = tf.train.ClusterSpec(cluster)
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=16)
    servers = [
        tf.distribute.Server(spec, job_name=job, task_index=i, config=config) for job in cluster for i in range(len(cluster[job]))
    ]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
    from chief.step.strategy import PeeredPSStrategy

    PeeredPSStrategy(resolver)  # connect this process first, as the chief does: later local variables live beside it
    yield resolver
    del servers
