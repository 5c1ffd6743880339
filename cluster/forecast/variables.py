"""The job's variables and the bytes each moves per step, and what train.dense = "allreduce" makes of
the job, from `python -m chief.variable_bytes` (it builds the job's model: a process of its own, so
cluster/ imports no chief/ module)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from cluster.errors import ConfigError
from cluster.forecast.model import Variable

TIMEOUT_S = 300.0


@dataclass(frozen=True)
class JobBytes:
    variables: list[Variable]
    allreduce_refused: str  # the launch's one line refusing train.dense = "allreduce" for the job; "" where it takes it
    slots: int  # the optimizer's slot variables per dense variable (Adam's 2): written back with the copies


def job_bytes(spec: str, examples_per_worker: int) -> JobBytes:
    """Raises ConfigError (one line) when the job cannot be built."""
    argv = [sys.executable, "-m", "chief.variable_bytes", spec, str(max(1, examples_per_worker))]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)  # killed and reaped on timeout
    except subprocess.TimeoutExpired:
        raise ConfigError(f"pstrain plan: building {spec}'s model took over {TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(f"pstrain plan: could not build {spec}'s model: {last.removeprefix('pstrain: error: ')}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return JobBytes([Variable(**v) for v in found["variables"]], found["allreduce_refused"], found["slots"])


def job_variables(spec: str, examples_per_worker: int) -> list[Variable]:
    """The job's variables alone (`job_bytes`)."""
    return job_bytes(spec, examples_per_worker).variables
