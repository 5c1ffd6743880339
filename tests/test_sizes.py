"""The house's size rules, read from the source: no module of chief/, worker/ or cluster/ over 450 lines, no
function over 80 (its `def` line to its last line)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("chief", "worker", "cluster")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_the_scan_reads_the_packages():
    assert len(sources()) > 50 and ROOT / "cluster" / "launch" / "watch.py" in sources()


def test_no_module_is_over_450_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


def test_no_function_is_over_80_lines():
    long = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_module_name_is_used_twice():
    """One name per module: two files of one name (slurm.py beside render/slurm.py) make a reader ask
    which one an error or a doc means. Package markers and entry points (__init__, __main__) aside."""
    by_name: dict[str, list[str]] = {}
    for path in sources():
        if path.stem not in ("__init__", "__main__"):
            by_name.setdefault(path.name, []).append(path.relative_to(ROOT).as_posix())
    twice = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not twice, f"module names used twice: {twice}"
