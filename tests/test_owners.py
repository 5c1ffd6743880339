"""Each contract has one owner that the rest passes around: TF_CONFIG is read from the environment in
cluster/tfconfig.py only, every PSTRAIN_* variable in cluster/taskenv.py only, and every path in a run
directory is made by cluster/rundir.py (RunDir). Read from the source of chief/, cluster/ and worker/. Pure."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("chief", "cluster", "worker")
ENV_OWNERS = {"cluster/taskenv.py", "cluster/tfconfig.py"}
RUN_DIR_OWNERS = {"cluster/rundir.py"}
# Where a process starts: `python -m chief`, `pstrain` (and `pstrain task`), `python -m worker`'s server, the
# doctor's probe process and `python -m chief.variable_bytes`; the example jobs, which a user's job imitates,
# read their data directory as a job would.
ENTRY_POINTS = {
    "chief/__main__.py",
    "cluster/cli.py",
    "cluster/launch/pod.py",
    "worker/server.py",
    "cluster/doctor/run.py",
    "cluster/doctor/probe.py",
    "cluster/control/agent.py",
    "chief/jobs/digits_files.py",
    "chief/jobs/digits_records.py",
}
# An environment read (os.environ/environ .get, .pop, [...], `in`; another process's, through psutil's
# Process.environ(); a mapping's env.get; getenv) naming PSTRAIN_*, TF_CONFIG or a *_ENV name: found in
# the syntax tree (`env_reads`), so strings, comments and line breaks neither hide one nor make one.
ENV_NAME = re.compile(r"^(?:PSTRAIN_\w+|TF_CONFIG|CUDA_VISIBLE_DEVICES)$")
ENV_CONSTANT = re.compile(r"^[A-Z_]+_ENV$")
RUN_DIR_JOIN = re.compile(r"\brun_dir\s*/(?!/)")


def offences(text: str, pattern: re.Pattern) -> list[str]:
    """The lines of `text` (as `N: line`) where `pattern` matches, comments left out."""
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if pattern.search(line.split("#")[0])]


def names_variable(node: ast.AST) -> bool:
    """Whether `node` names a variable of the owned contracts: a literal PSTRAIN_*, TF_CONFIG or
    CUDA_VISIBLE_DEVICES, or a constant named *_ENV."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return bool(ENV_NAME.match(node.value))
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return bool(ENV_CONSTANT.match(name))


def is_environ(node: ast.AST) -> bool:
    """Whether `node` is an environment mapping: `environ*`, `x.environ*`, or a call of one (`p.environ()`)."""
    if isinstance(node, ast.Call):
        node = node.func
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.startswith("environ")


def env_reads(text: str) -> list[str]:
    """`N: source` of each environment read in `text` naming an owned variable (see ENV_NAME)."""
    found = []
    for node in ast.walk(ast.parse(text)):
        read = False
        if isinstance(node, ast.Subscript):
            read = is_environ(node.value) and names_variable(node.slice)
        elif isinstance(node, ast.Call) and node.args and names_variable(node.args[0]):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "pop"):
                read = is_environ(func.value) or (isinstance(func.value, ast.Name) and func.value.id == "env")
            else:
                read = (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) == "getenv"
        elif isinstance(node, ast.Compare) and names_variable(node.left):
            pairs = zip(node.ops, node.comparators, strict=True)
            read = any(isinstance(op, ast.In | ast.NotIn) and is_environ(c) for op, c in pairs)
        if read:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def scan(find, owners: set[str]) -> list[str]:
    """`find(text)` over every module of PACKAGES but `owners`, as `module:N: source`."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name not in owners:
                found += [f"{name}:{line}" for line in find(path.read_text())]
    return found


def test_the_scans_see_what_they_look_for():
    reads = [
        'os.environ.get("PSTRAIN_READ_AHEAD", "1")',
        'os.environ["TF_CONFIG"]',
        "environ.get(CONTROL_ENV)",
        "if TOKEN_ENV in os.environ:\n    pass",
        "os.getenv('PSTRAIN_RUN_DIR')",
        'os.environ.pop("TF_CONFIG", None)',
        'text = env.get("PSTRAIN_GPU_MEMORY_MB", "")',
        'config = process.environ().get("TF_CONFIG")',
        '"TF_CONFIG" in p.environ()',
        'os.environ.get("CUDA_VISIBLE_DEVICES")',
        'value = os.environ.get(\n    "TF_CONFIG",\n)',  # across lines: a line scan missed this
    ]
    assert all(env_reads(line) for line in reads), [line for line in reads if not env_reads(line)]
    fine = [
        "env[TF_CONFIG_ENV] = text",
        "print(\"os.environ['TF_CONFIG']\")",  # a string that quotes a read is not one
        'os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")',
        "# os.environ['TF_CONFIG']",
    ]
    assert not any(env_reads(line) for line in fine)
    assert offences('path = run_dir / "saved_model"', RUN_DIR_JOIN) and offences("run_dir/'data'", RUN_DIR_JOIN)
    assert not offences("run_dir.saved_model, self.run_dir_path", RUN_DIR_JOIN)


def test_only_the_owners_read_pstrain_variables_and_tf_config():
    found = scan(env_reads, ENV_OWNERS)
    assert not found, "read outside cluster/taskenv.py and cluster/tfconfig.py: " + "; ".join(found)


def test_only_entry_points_read_the_task_environment_and_the_switches():
    """TaskEnv.from_env(), Switches.from_env() and gpu_visibility() are read where a process starts (its
    entry point, or the owner's own helpers) and passed on: a read deep inside (the dispatch, the trainer)
    hides what a module depends on."""
    call = re.compile(r"^(?:TaskEnv\.from_env|Switches\.from_env|gpu_visibility)$")
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in ENV_OWNERS | ENTRY_POINTS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and call.match(ast.unparse(node.func)):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "read outside the entry points (pass it in): " + "; ".join(found)


def test_only_rundir_makes_run_dir_paths():
    found = scan(lambda text: offences(text, RUN_DIR_JOIN), RUN_DIR_OWNERS)
    assert not found, "run-dir paths made outside cluster/rundir.py (add a RunDir property): " + "; ".join(found)


# The modules that build a RunDir (issue 37: at most 4 outside cluster/rundir.py): where a run directory
# enters a process, each building one and passing it down: `python -m chief`, `pstrain` (every command:
# launch, Ray, Slurm, task, status, evaluate, ...), `python -m cluster.doctor.gpu_check`, and `pstrain
# plan`'s measure, which makes the temporary run dir it measures. Exactly these: a module that builds its
# own fails, and so does one listed that no longer does.
RUN_DIR_BUILDERS = {
    "chief/__main__.py",
    "cluster/cli.py",
    "cluster/doctor/gpu_check.py",
    "cluster/forecast/measure.py",
}


def test_no_new_module_builds_its_own_run_dir():
    """Read by AST: a call of RunDir (or rundir.RunDir) anywhere in a module, inside functions included."""
    builders = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "RunDir":
                    builders.add(name)
    builders -= RUN_DIR_OWNERS
    assert len(RUN_DIR_BUILDERS) <= 4, "issue 37's bound: at most 4 modules outside cluster/rundir.py build a RunDir"
    new, gone = sorted(builders - RUN_DIR_BUILDERS), sorted(RUN_DIR_BUILDERS - builders)
    assert not new, "builds its own RunDir (take it from the caller): " + ", ".join(new)
    assert not gone, "no longer builds one: drop it from RUN_DIR_BUILDERS: " + ", ".join(gone)


CHECKPOINT_NAME = re.compile(r"ckpt")


def checkpoint_name_makers(source: str) -> list[str]:
    """The lines of `source` whose code (a string or f-string, a pattern; not a docstring or a comment)
    names a checkpoint file `ckpt...`: what builds or parses the name. Read by AST."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        if CHECKPOINT_NAME.search(node.value)
    ]


def test_the_checkpoint_name_scan_sees_what_it_looks_for():
    made = ['prefix = directory / f"ckpt-{step}"', 'glob("ckpt-*.index")', 're.compile(r"(ckpt-\\d+)\\.data")']
    assert all(checkpoint_name_makers(line) for line in made), [line for line in made if not checkpoint_name_makers(line)]
    fine = ['def f():\n    """Writes `ckpt-N_temp`."""\n', "x = 1  # ckpt-3", "checkpoint_name(step)", '"checkpoint"']
    assert not any(checkpoint_name_makers(line) for line in fine)


def test_only_rundir_names_checkpoints():
    """`ckpt-N` (checkpoint N's prefix, its index, data and temp files) is built and parsed in
    cluster/rundir.py only (checkpoint_name, checkpoint_step, checkpoint_prefixes, partial_saves,
    newest_checkpoint_bytes); everything else asks it."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name not in RUN_DIR_OWNERS:
                found += [f"{name}:{line}" for line in checkpoint_name_makers(path.read_text())]
    assert not found, "a checkpoint name made outside cluster/rundir.py (ask its checkpoint functions): " + "; ".join(found)
    assert checkpoint_name_makers((ROOT / "cluster/rundir.py").read_text()), "the scan must see rundir.py's own"
