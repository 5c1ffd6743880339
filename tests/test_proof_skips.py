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


def test_a_module_that_skips_as_it_is_imported_counts_for_every_proof_test_in_it():
    """pytest.importorskip at a module's top (both Ray files) skips the whole module at collection: its
    path then stands for every proof test in it."""
    assert unallowed_skips(["tests/system/test_ray.py"], "") == ["tests/system/test_ray.py"]
    module = "tests/system/test_unshared_checkpoints.py"
    inside = sorted(p for p in PROOF if p.startswith(module + "::"))
    assert len(inside) == 2 and unallowed_skips([module], "") == inside
    assert unallowed_skips([module], inside[0]) == inside[1:]
    assert unallowed_skips([module], module) == []
    assert unallowed_skips(["tests/system/test_worker_data.py"], "") == []


def test_the_session_hears_of_a_module_skipped_at_collection():
    """tests/conftest.py records a collection-time skip, which never reaches pytest_runtest_logreport."""
    from tests import conftest

    report = pytest.CollectReport("tests/system/test_ray.py", "skipped", ("x.py", 1, "Skipped: no ray"), [])
    before = list(conftest._skipped)
    try:
        conftest.pytest_collectreport(report)
        assert conftest._skipped[len(before) :] == ["tests/system/test_ray.py"]
        conftest.pytest_collectreport(pytest.CollectReport("tests/system/test_ray.py", "passed", None, []))
        assert len(conftest._skipped) == len(before) + 1
    finally:
        conftest._skipped[:] = before


# Tests the docs cite that may skip, and why their skip is not a missing proof.
NOT_PROOF = {
    # a size the machine may lack; docs/testing.md says when it skips and how to run it anyway
    "tests/system/test_worker_data.py::test_big_array_set_trains": "needs about 7 GiB of free memory",
}


def skippable_tests(root) -> dict[str, str]:
    """Every test under tests/ that can skip, as node id -> its file: a module whose `pytestmark` skips
    (netns_tier) or that skips as it is imported, a test marked skip/skipif/gpu, or one that calls pytest.skip."""
    import ast
    import re

    found = {}
    for path in sorted((root / "tests").rglob("test_*.py")):
        name = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text())
        whole = False
        for node in tree.body:
            text = ast.unparse(node)
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
                whole |= "netns_tier" in text or re.search(r"mark\.skip(if)?\b", text) is not None
            if isinstance(node, ast.Expr) and re.search(r"pytest\.(importorskip|skip)\(", text):
                whole = True
        for test in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
            marks = " ".join(ast.unparse(d) for d in test.decorator_list)
            if whole or re.search(r"mark\.(skip|skipif|gpu)\b", marks) or "pytest.skip(" in ast.unparse(test):
                found[f"{name}::{test.name}"] = name
    return found


def test_every_test_the_docs_cite_that_can_skip_is_a_proof_test():
    """A test a doc cites (its file, its node id, or a node id cut short with …) that can skip is on the proof
    list, or NOT_PROOF says why its skip proves nothing missing."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cited = set()
    for doc in [*(root / "docs").glob("*.md"), root / "README.md"]:
        cited |= set(re.findall(r"tests/[\w/]+\.py(?:::\w+…?)?", doc.read_text()))
    can_skip = skippable_tests(root)
    assert "tests/system/test_ray.py::test_ctrl_c_or_sigterm_checkpoints_stops_and_leaves_nothing" in can_skip  # importorskip
    assert "tests/system/test_two_machines.py::test_training_across_two_hosts" in can_skip  # netns_tier

    def is_cited(node: str, path: str) -> bool:
        return any(c in (path, node) or (c.endswith("…") and node.startswith(c[:-1])) for c in cited)

    missing = [
        n for n, path in can_skip.items() if is_cited(n, path) and n not in NOT_PROOF and not any(covers(p, n) for p in PROOF)
    ]
    assert not missing, "cited by the docs, can skip, not on tests/proof.py: " + ", ".join(missing)
