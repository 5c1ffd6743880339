"""The versions a task reports when it registers; all tasks of a cluster must agree."""

from __future__ import annotations

import platform
from importlib import metadata

from cluster import __version__


def tensorflow_version() -> str:
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "none"


def local_versions() -> dict[str, str]:
    return {"pstrain": __version__, "tensorflow": tensorflow_version(), "python": platform.python_version()}
