"""The import graph has no upward import and no circle: every `import` in chief/, worker/ and cluster/ (module level
or inside a function, where a circle hides) read from the source, checked against the direction the rooms allow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("chief", "worker", "cluster")
ROOMS = ("chief.step", "chief.data", "chief.state")  # below the run loop and its views
CONTRACT = ("chief.contract",)  # the job contract: below the rooms
WORKER_ROOMS = ("worker.ps", "worker.replica", "worker.input")  # the code that runs on the ps and the workers
# What the worker rooms may use of the chief: the job contract (the job's own code, and what its framework's
# variables are); the model state is the chief's to build.
WORKER_ROOMS_USE = ("chief.contract",)
# The `pstrain` command dispatches to the chief's entry points (train, evaluate, plot), importing them lazily.
CLI_INTO_CHIEF = {("cluster.cli", "chief.plots"), ("cluster.cli", "chief.sidecar"), ("cluster.cli", "chief.trainer")}


def is_module(name: str) -> bool:
    """Whether `name` is a pstrain module or package (a file or a folder under ROOT)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement loads: `from cluster import rundir` is cluster.rundir (a module
    imported from its package), `from cluster.rundir import RunDir` is cluster.rundir."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [f"{node.module}.{a.name}" if is_module(f"{node.module}.{a.name}") else node.module for a in node.names]


def imports() -> set[tuple[str, str]]:
    """(importing module, imported module) for every import of a pstrain package by a pstrain module."""
    edges = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level:
                    raise AssertionError(f"{module}: relative import; pstrain imports by absolute name")
                if isinstance(node, ast.Import | ast.ImportFrom):
                    edges |= {(module, name) for name in imported(node) if name.split(".")[0] in PACKAGES}
    return edges


def within(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_scan_sees_imports_inside_functions():
    """cluster/cli.py imports the chief only inside functions: the scan must see those to check anything."""
    assert CLI_INTO_CHIEF <= imports()


def test_the_scan_sees_a_module_imported_from_its_package():
    """`from worker import tf_runtime` imports worker.tf_runtime, not the package worker: an edge to the
    package would hide what the module reaches."""
    edges = imports()
    assert ("worker.server", "worker.tf_runtime") in edges
    assert not any(b in PACKAGES for _, b in edges if b != "cluster"), sorted((a, b) for a, b in edges if b in PACKAGES)


def test_no_module_imports_upward():
    edges = imports()
    wrong = sorted(
        f"{a} imports {b}"
        for a, b in edges
        # the server boot (worker/__main__, server, tf_runtime): a passive task, no launcher, no chief, no
        # step code (it never imports TensorFlow's Python API)
        if (within(a, "worker") and not within(a, *WORKER_ROOMS) and within(b, "chief", "cluster.launch", *WORKER_ROOMS))
        or (within(a, *WORKER_ROOMS) and within(b, "chief", "cluster.launch") and not within(b, *WORKER_ROOMS_USE))
        or (within(a, "cluster") and within(b, "chief", *WORKER_ROOMS) and (a, b) not in CLI_INTO_CHIEF)
        or (within(a, *ROOMS, *CONTRACT) and within(b, "chief") and not within(b, *ROOMS, *CONTRACT))
        or (within(a, "chief.data", "chief.state", *CONTRACT) and within(b, "chief.step"))  # the step uses data and state
        or (within(a, "chief.state", *CONTRACT) and within(b, *WORKER_ROOMS))  # the programs read the state, not back
        or (within(a, *CONTRACT) and within(b, "chief.jobs"))  # the contract never reaches into the examples
    )
    assert not wrong, "upward imports: " + "; ".join(wrong)


def circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The import circles of `edges`: each set of modules that reach each other, sorted (Tarjan's algorithm)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = [stack.pop()]
            while group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1 or (v, v) in edges:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_circle_finder_finds_circles():
    assert circles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d")}) == [["a", "b", "c"], ["d", "e"]]
    assert circles({("a", "b"), ("b", "c"), ("a", "c")}) == []


def test_no_import_circle():
    """A circle (job -> job_compiled -> state/initial_values -> job, say) works only while one of its imports
    stays inside a function; the modules of one are not in layers."""
    found = circles(imports())
    assert not found, "import circles: " + "; ".join(" <-> ".join(group) for group in found)
