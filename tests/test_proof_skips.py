"""A skip of a proof test fails CI unless the run allows it by name (tests/proof.py). Pure."""

from __future__ import annotations

import pytest

from tests.proof import PROOF, covers, unallowed_skips

pytestmark = pytest.mark.pure

SLURM = "tests/system/test_slurm.py::test_real_slurm_sbatch_stops_with_a_checkpoint_on_the_time_limit_signal_and_resumes"


def test_a_skipped_proof_test_is_reported_unless_allowed():
    skipped = [
        SLURM,
        "tests/system/test_two_machines.py::test_x[a]",
        "tests/system/test_worker_data.py::test_big_array_set_trains",
    ]
    assert unallowed_skips(skipped, "") == sorted(skipped[:2])
    assert unallowed_skips(skipped, f" {SLURM} ,tests/system/test_two_machines.py") == []
    assert unallowed_skips(skipped, "tests/system/test_two_machines.py::test_x") == [SLURM]  # its parameters included
    assert unallowed_skips(skipped, "tests/system/test_slurm.py::test_real") == sorted(skipped[1:2] + [SLURM])  # no prefix match


def test_every_proof_test_exists():
    """A renamed proof test would otherwise never be seen skipping."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for name in PROOF:
        path, _, test = name.partition("::")
        assert (root / path).exists(), path
        if test:
            defined = {n.name for n in ast.walk(ast.parse((root / path).read_text())) if isinstance(n, ast.FunctionDef)}
            assert test in defined, name
    assert covers("tests/a.py", "tests/a.py::t[1]") and not covers("tests/a.py::t", "tests/a.py::t2")
