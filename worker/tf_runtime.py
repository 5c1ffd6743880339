"""TensorFlow's runtime for a process that only serves, without building TensorFlow's Python API.

A ps or worker runs what the chief's functions send it: TF's C++ runtime, its kernels and its gRPC
server. None of the job's Python runs there. `import tensorflow` also builds the whole Python API
(`tf.*`, `tf.compat.v1`, Keras's optimizers), about 3.3 s of CPU per process, and a local cluster
starts three such servers next to the chief on the same cores. `load()` imports the modules a
server needs (`server_lib`, `config`) under a bare `tensorflow` package, about 1 s of CPU, and loads
the kernel and device plugins as `tensorflow/__init__.py` would. The runtime it loads is the same
shared library, so what the servers execute does not change.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import site
import sys
import sysconfig
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("pstrain.server")


@dataclass(frozen=True)
class Runtime:
    """What a server uses of TensorFlow, as `tf.train.ClusterSpec`, `tf.distribute.Server`,
    `tf.config.list_physical_devices` and `tf.config.experimental.get_memory_info`."""

    ClusterSpec: Any  # TF's names
    Server: Any
    list_physical_devices: Any
    get_memory_info: Any
    lean: bool  # False where the full `import tensorflow` ran (already imported, or the lean path failed)


def load() -> Runtime:
    """TF's runtime, imported lean unless `tensorflow` is already imported in this process."""
    if "tensorflow" not in sys.modules:
        try:
            return _load_lean()
        except (ImportError, AttributeError) as e:  # a TF whose internals moved: the full import still serves
            # Only the bare package goes: its submodules stay imported (TF's extensions cannot load twice),
            # and the real tensorflow/__init__.py reuses them.
            sys.modules.pop("tensorflow", None)
            log.info("lean TensorFlow import failed (%s); importing all of it", e)
    import tensorflow as tf

    return Runtime(
        tf.train.ClusterSpec, tf.distribute.Server, tf.config.list_physical_devices, tf.config.experimental.get_memory_info, False
    )


def _load_lean() -> Runtime:
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("tensorflow is not installed")
    package = types.ModuleType("tensorflow")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__file__ = spec.origin
    # What tensorflow/__init__.py sets before its first import.
    os.environ.setdefault("ENABLE_RUNTIME_UPTIME_TELEMETRY", "1")
    os.environ["TF2_BEHAVIOR"] = "1"
    sys.modules["tensorflow"] = package
    from tensorflow.python.framework import config, load_library
    from tensorflow.python.training import server_lib

    _load_plugins(load_library, Path(spec.origin).parent)
    return Runtime(server_lib.ClusterSpec, server_lib.Server, config.list_physical_devices, config.get_memory_info, True)


def _load_plugins(load_library: Any, tf_dir: Path) -> None:
    """Kernel and pluggable-device libraries, found where `tensorflow/__init__.py` looks for them."""
    kernels = tf_dir / "core" / "kernels"
    if kernels.exists():
        load_library.load_library(str(kernels))
    site_dirs = {p for p in sys.path if "site-packages" in p} | set(site.getsitepackages())
    if site.ENABLE_USER_SITE and site.USER_SITE is not None:
        site_dirs.add(site.USER_SITE)
    site_dirs |= {sysconfig.get_path(name, scheme) for scheme in sysconfig.get_scheme_names() for name in ("purelib", "platlib")}
    for directory in sorted(d for d in site_dirs if d):
        plugins = Path(directory) / "tensorflow-plugins"
        if plugins.exists():
            load_library.load_library(str(plugins))
            load_library.load_pluggable_device_library(str(plugins))
    if os.getenv("TF_PLUGGABLE_DEVICE_LIBRARY_PATH", ""):
        load_library.load_pluggable_device_library(os.environ["TF_PLUGGABLE_DEVICE_LIBRARY_PATH"])
