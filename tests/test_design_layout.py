"""docs/design.md's Layout lists every module of chief/, worker/ and cluster/ as it is: a module missing from
it, or an entry naming a file or folder that is gone, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("chief", "worker", "cluster")
DESCRIPTION_COLUMN = 18  # a line indented this far continues the entry above it


def layout_block(text: str) -> list[str]:
    """The lines of the code block under `## Layout`."""
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1].strip("\n").splitlines()


def entries(lines: list[str]) -> dict[str, str]:
    """Each entry of the layout block: its path (a folder ends in /) -> its description, continuation
    lines included. An entry's indent (2 per level) places it inside the folder entry above it."""
    out: dict[str, str] = {}
    folders: list[str] = []  # the folder entries enclosing the current line, by level
    current: list[str] = []
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        if indent >= DESCRIPTION_COLUMN:
            for path in current:
                out[path] += " " + line.strip()
            continue
        names, _, description = line.strip().partition("  ")
        level = indent // 2
        del folders[level:]
        parent = "".join(folders)
        current = [parent + name.strip() for name in names.split(",")]
        for path in current:
            out[path] = description.strip()
        if len(current) == 1 and current[0].endswith("/"):
            folders.append(current[0].removeprefix(parent))
    return out


def modules() -> list[Path]:
    found = []
    for package in PACKAGES:
        found += [p.relative_to(ROOT) for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py"]
    return sorted(found)


def described(module: Path, layout: dict[str, str]) -> bool:
    """`module` has an entry of its own, or its name stands as a word in the entry of its nearest listed folder."""
    if module.as_posix() in layout:
        return True
    for folder in module.parents:
        key = folder.as_posix() + "/"
        if key in layout:
            return re.search(rf"(?<![\w.]){re.escape(module.stem)}(?!\w)", layout[key]) is not None
    return False


@pytest.fixture(scope="module")
def layout() -> dict[str, str]:
    return entries(layout_block((ROOT / "docs" / "design.md").read_text()))


def test_the_parser_reads_the_entries(layout):
    """The check below means something only if the block is read as entries inside folders."""
    assert {"cluster/", "cluster/config.py", "cluster/launch/", "chief/step/", "worker/"} <= set(layout)
    assert "ClusterWatch" in layout["cluster/launch/"]


def test_every_module_is_in_the_layout(layout):
    missing = [m.as_posix() for m in modules() if not described(m, layout)]
    assert not missing, "docs/design.md's Layout does not list: " + ", ".join(missing)


def test_every_entry_names_what_exists(layout):
    gone = [path for path in layout if not (ROOT / path.rstrip("/")).exists()]
    assert not gone, "docs/design.md's Layout names what does not exist: " + ", ".join(gone)
