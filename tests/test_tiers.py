"""The tier guard of tests/conftest.py, run on small test files in a pytester session of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def guarded(pytester):
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makefile(".ini", pytest=(TESTS.parent / "pytest.ini").read_text().replace("addopts = -ra --durations=15", ""))
    return pytester


@pytest.mark.pure
def test_a_test_without_one_tier_marker_is_refused_at_collection(guarded):
    guarded.makepyfile(
        test_x="""
        import pytest

        def test_unmarked():
            pass

        @pytest.mark.pure
        @pytest.mark.cluster
        def test_two_tiers():
            pass

        @pytest.mark.pure
        def test_fine():
            pass
        """
    )
    result = guarded.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_x.py::test_unmarked has no tier marker*test_x.py::test_two_tiers has cluster and pure*"])
    assert "test_fine" not in result.stderr.str()


@pytest.mark.cluster  # its cluster test starts a process
def test_a_pure_test_that_starts_a_process_fails_and_a_cluster_test_may(guarded):
    guarded.makepyfile(
        test_y="""
        import subprocess, sys
        import pytest

        @pytest.mark.pure
        def test_pure_starts_a_process():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        @pytest.mark.cluster
        def test_cluster_starts_a_process():
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        """
    )
    result = guarded.runpytest("-q")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*a pure test started a process*mark it cluster*"])


@pytest.mark.pure
def test_a_hang_fails_at_the_time_limit_naming_the_test_and_its_teardown_runs(guarded):
    """pytest.ini gives every test a limit (pytest-timeout, 600 s); a hang fails that test, named, and the
    signal method still runs its fixtures' teardown (where a test's processes are reaped)."""
    import time

    guarded.makepyfile(
        test_z="""
        import time
        import pytest

        @pytest.fixture
        def held():
            yield
            print("teardown ran")

        @pytest.mark.pure
        def test_hangs(held):
            time.sleep(60)
        """
    )
    assert guarded.parseconfig().getini("timeout") == "600"
    start = time.monotonic()
    result = guarded.runpytest("-q", "-s", "--timeout=2")
    assert time.monotonic() - start < 30
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Timeout (>2.0s)*", "*FAILED test_z.py::test_hangs*"])
    assert "teardown ran" in result.stdout.str()
