"""One exit path for every role: errors that carry their exit code, and the codes themselves.

Code anywhere raises a `PstrainError` subclass with a one-line message that names the field or
function and the fix; only the entry points (`pstrain`, `python -m chief`, `python -m worker`) catch
it, print `pstrain: error: <message>` and exit with `error.exit_code`. Pure: no imports beyond the
standard library, so every role may import it.
"""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_FAILURE = 1  # training failed (NaN loss, a job that raises, a task lost for good)
EXIT_USAGE = 2  # a user mistake in the config, the flags, the job or the environment
EXIT_RESTARTABLE = 75  # EX_TEMPFAIL: a cluster task became unreachable; restarting resumes


class PstrainError(Exception):
    """An error meant for the user: its message is shown as is, without a traceback."""

    exit_code = EXIT_FAILURE


class ConfigError(PstrainError, ValueError):
    """A user mistake in the config, the flags or the environment (TF_CONFIG, SLURM_*)."""

    exit_code = EXIT_USAGE


class TrainingError(PstrainError):
    """Training cannot go on (a NaN loss, say); the message says at which step and why."""

    exit_code = EXIT_FAILURE


class RestartableError(PstrainError):
    """A cluster task became unreachable; running the same command again resumes from the checkpoint."""

    exit_code = EXIT_RESTARTABLE


def signal_exit_code(signum: int) -> int:
    """The exit code of a process that stopped because of signal `signum`, as a shell reports it."""
    return 128 + int(signum)


def returncode_exit_code(returncode: int) -> int:
    """Popen's returncode (-N for "killed by signal N") as a shell would report it."""
    return signal_exit_code(-returncode) if returncode < 0 else returncode


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
