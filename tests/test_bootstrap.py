"""deploy/bootstrap.sh is safe to source in a user's shell: it puts .venv/bin (with `pstrain`) on PATH
and leaves the shell's options as they were, so a failing command afterwards does not end the shell."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.cluster  # starts bash


def bash(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("options", ["", "set -e", "set -u -o pipefail"], ids=["interactive", "set-e", "set-u-pipefail"])
def test_sourcing_leaves_the_shell_options_and_puts_pstrain_on_path(options):
    result = bash(
        f"""{options}
        before=$(set +o; shopt -p)
        source deploy/bootstrap.sh
        after=$(set +o; shopt -p)
        [ "$before" = "$after" ] && echo options-unchanged
        command -v pstrain
        """
        + ("" if "set -e" in options else "false\necho survived-a-failing-command\n")
    )
    assert result.returncode == 0, result.stderr
    assert "options-unchanged" in result.stdout, result.stdout + result.stderr
    assert f"{ROOT}/.venv/bin/pstrain" in result.stdout, result.stdout
    if "set -e" not in options:
        assert "survived-a-failing-command" in result.stdout


def test_a_failed_set_up_returns_to_an_interactive_shell_with_its_status():
    """A set-up that cannot run (an interpreter too old or missing) says so in one line and returns 2;
    the shell goes on, its options unchanged, PATH without a .venv that was not made."""
    result = bash(
        """before=$(set +o) path=$PATH
        PSTRAIN_VENV=$(mktemp -d)/venv PYTHON=/nonexistent/python3 source deploy/bootstrap.sh
        echo "status $?"
        [ "$before" = "$(set +o)" ] && echo options-unchanged
        [ "$path" = "$PATH" ] && echo path-unchanged
        """
    )
    assert "status 2" in result.stdout and "options-unchanged" in result.stdout, result.stdout + result.stderr
    assert "path-unchanged" in result.stdout, result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        "pstrain: error: /nonexistent/python3 is not a Python 3.11 or newer; set PYTHON to one"
    ), result.stderr
