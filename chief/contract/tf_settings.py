"""TensorFlow settings a job's module makes at import (threads, visible devices, memory growth), which
TF accepts only before it is initialized.

A cluster chief joins the cluster (chief/step/dispatch.py `connect`) before it imports the job, so
TF is initialized by then and these calls raise RuntimeError ("... cannot be modified after
initialization"). They only tune the chief's own process: the model runs on the workers and ps,
whose settings pstrain makes. While the job's module is imported, such a call that TF refuses is
skipped and noted in the chief's log (`skipped_settings`), instead of failing the run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import tensorflow as tf

log = logging.getLogger("pstrain.chief")

# (module, function name): the tf.config setters that raise once TF is initialized.
SETTERS = (
    (tf.config.threading, "set_inter_op_parallelism_threads"),
    (tf.config.threading, "set_intra_op_parallelism_threads"),
    (tf.config, "set_visible_devices"),
    (tf.config.experimental, "set_visible_devices"),
    (tf.config, "set_logical_device_configuration"),
    (tf.config.experimental, "set_virtual_device_configuration"),
    (tf.config.experimental, "set_memory_growth"),
)
PATHS = {
    id(tf.config.threading): "tf.config.threading",
    id(tf.config): "tf.config",
    id(tf.config.experimental): "tf.config.experimental",
}


@contextlib.contextmanager
def skipped_settings(spec: str) -> Iterator[list[str]]:
    """Within the block, a SETTERS call TF refuses with RuntimeError (it is initialized) is skipped and
    logged; yields the list of the skipped calls' names. The setters are restored on exit."""
    skipped: list[str] = []
    originals = [(module, name, getattr(module, name)) for module, name in SETTERS]

    def tolerant(setter, path):
        @functools.wraps(setter)
        def call(*args, **kwargs):
            try:
                return setter(*args, **kwargs)
            except RuntimeError as e:
                skipped.append(path)
                log.info(
                    "--job %s: %s at import skipped: TensorFlow is already initialized in the chief, which joins "
                    "the cluster before importing the job (%s); it would tune only the chief, not the workers and "
                    "ps that run the model",
                    spec,
                    path,
                    e,
                )
                return None

        return call

    for module, name, setter in originals:
        setattr(module, name, tolerant(setter, f"{PATHS[id(module)]}.{name}"))
    try:
        yield skipped
    finally:
        for module, name, setter in originals:
            setattr(module, name, setter)
