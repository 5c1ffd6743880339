"""What preprocessing layers adapt in `model_fn` (a vocabulary, a mean and variance): the same at every
start of a run, or the resume is refused.

`model_fn()` adapts them again at each start. A checkpoint holds a Normalization's statistics but not
a lookup layer's vocabulary, and the training model keeps what its own adapt computed: a resume whose
adapt differs (the data it adapts on changed) would train and export another model than the one
checkpointed, an embedding row now standing for another token. The first start records a digest per
adapted layer in RUN_DIR/adapted.json (`cluster.rundir.RunDir.adapted`); a resume must match it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from chief.contract.job import JobError


def adapted_digests(model) -> list[str]:
    """ "<layer class> <digest of its weights>" for each adapted preprocessing layer, in layer order."""
    found = []
    for layer in model._flatten_layers():
        if not getattr(layer, "is_adapted", False):
            continue
        digest = hashlib.sha256()
        for weight in layer.get_weights():  # a vocabulary (text), statistics and counts (numbers)
            value = np.asarray(weight)
            text = value.dtype.kind in "OSU"
            digest.update("\0".join(map(str, value.ravel().tolist())).encode() if text else value.tobytes())
        found.append(f"{type(layer).__name__} {digest.hexdigest()[:16]}")
    return found


def check_adapted(model, record: Path, resumed: bool) -> None:
    """On a resume, raise JobError if the adapted layers differ from `record`; else (re)write it."""
    digests = adapted_digests(model)
    if resumed and record.exists():
        saved = json.loads(record.read_text())
        if saved == digests:
            return
        if len(saved) != len(digests):
            what = f"adapts {len(digests)} preprocessing layers, where this run started with {len(saved)}"
        else:
            layer = next(now.split()[0] for now, then in zip(digests, saved, strict=True) if now != then)
            what = f"its adapted {layer} differs from the one this run started with (the data it adapts on changed)"
        raise JobError(
            f"model_fn: {what}: the checkpoint's weights belong to the old one; adapt on the same data, or use a new --run-dir"
        )
    if digests or record.exists():
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps(digests))
        tmp.replace(record)
