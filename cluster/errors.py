"""One exit path for every role: errors that carry their exit code, and the codes themselves.

Code anywhere raises a `PstrainError` subclass with a one-line message that names the field or
function and the fix; only the entry points (`pstrain`, `python -m chief`, `python -m worker`) catch
it, print it with `report` (the one formatter: `pstrain: error: <message>`) and exit with
`error.exit_code`. Pure: no imports beyond the standard library, so every role may import it.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

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


class JobError(ConfigError):
    """A job that cannot be used; the message says what is wrong and how to fix it (chief/contract/job.py)."""


class TrainingError(PstrainError):
    """Training cannot go on (a NaN loss, say); the message says at which step and why."""

    exit_code = EXIT_FAILURE


class RestartableError(PstrainError):
    """A cluster task became unreachable; running the same command again resumes from the checkpoint."""

    exit_code = EXIT_RESTARTABLE


def error_line(message: object) -> str:
    """The one console form of an error: `pstrain: error: <message>`."""
    return f"pstrain: error: {message}"


def report(error: PstrainError | str, exit_code: int | None = None) -> int:
    """Print `error` on stderr as `error_line` does; returns its exit code (`exit_code` where given,
    else the error's own, else EXIT_FAILURE for a bare message)."""
    print(error_line(error), file=sys.stderr, flush=True)
    if exit_code is not None:
        return exit_code
    return error.exit_code if isinstance(error, PstrainError) else EXIT_FAILURE


def signal_exit_code(signum: int) -> int:
    """The exit code of a process that stopped because of signal `signum`, as a shell reports it."""
    return 128 + int(signum)


def returncode_exit_code(returncode: int) -> int:
    """Popen's returncode (-N for "killed by signal N") as a shell would report it."""
    return signal_exit_code(-returncode) if returncode < 0 else returncode


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class UserCodeError(PstrainError):
    """An exception raised by the job's own code (model_fn, a data function, loss_fn, a layer's call)."""

    exit_code = EXIT_USAGE


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_GRPC = re.compile(r'grpc_message:"((?:[^"\\]|\\.)*)"')
_REMOTE = re.compile(r"\nAdditional GRPC error information from remote target /job:worker/replica:\d+/task:(\d+)")
_ROOT_ERRORS = re.compile(r"^\s*(Graph execution error:\s*)?\d+ root error\(s\) found\.\s*\(0\) [A-Z_]+:\s*")
_NEXT_ROOT_ERROR = re.compile(r"\n\s*\(1\) [A-Z_]+:|\n\d+ successful operations")
_TF_NOISE = re.compile(r"\[\[\{\{node [^}]*\}\}\]\]|\{\{function_node [^}]*\}\}|\[Op:[^\]]*\]|Graph execution error:")


def job_frame(error: BaseException, job_file: str) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost place in `job_file` that `error` passed through: a frame
    of its traceback (or of a cause's), else the last such frame TensorFlow quotes in its message (where
    a traced op was defined, for an error raised when the graph runs). None: the job's code is not involved."""
    target = os.path.realpath(job_file)
    seen, found = set(), None
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen and found is None:
        seen.add(id(cause))
        frames = [f for f in traceback.extract_tb(cause.__traceback__) if os.path.realpath(f.filename) == target]
        if frames:
            found = (frames[-1].filename, frames[-1].lineno or 0, frames[-1].name)
        cause = cause.__cause__ or cause.__context__
    if found:
        return found
    quoted = [m for m in _FRAME.finditer(str(error)) if os.path.realpath(m.group(1)) == target]
    return (quoted[-1].group(1), int(quoted[-1].group(2)), quoted[-1].group(3)) if quoted else None


def error_text(error: BaseException) -> str:
    """The exception's own message on one line: without gRPC's wrapping, TensorFlow's node names and the
    definition traceback TensorFlow quotes (the message follows its last frame)."""
    text = str(getattr(error, "message", None) or error)
    text = text.split("\nAdditional GRPC error information", 1)[0]
    frames = list(_FRAME.finditer(text))
    if frames:  # '  File "x.py", line 3, in f\n[    source line]\n\nthe message'
        rest = text[frames[-1].end() :]
        text = rest.split("\n\n", 1)[1] if "\n\n" in rest.strip("\n") else rest
        text = text.strip().removeprefix(f"{type(error).__name__}: ")  # autograph repeats the type
    elif grpc := _GRPC.search(text):  # ':UNKNOWN:Error received from peer {grpc_status:3, grpc_message:"..."}'
        text = grpc.group(1).replace("\\n", "\n").replace("\\t", " ").replace('\\"', '"')
    text = _ROOT_ERRORS.sub("", text, count=1)
    text = _NEXT_ROOT_ERROR.split(text, maxsplit=1)[0]  # several workers failing alike: the first one
    text = " ".join(_TF_NOISE.sub(" ", text).split())
    return text[:240] + (" ..." if len(text) > 240 else "")


def failed_worker(error: BaseException) -> int | None:
    """The worker a remote error came from, where TensorFlow's message names it."""
    found = _REMOTE.search(str(getattr(error, "message", None) or error))
    return int(found.group(1)) if found else None


def user_error(error: BaseException, job_file: str, step: int | None = None, worker: int | None = None) -> UserCodeError | None:
    """One line for an exception raised in the job's code (None when it was not): the exception, the
    job's file:line, and for an error while training the step and the worker (named by TensorFlow's
    message unless given)."""
    frame = job_frame(error, job_file) if job_file else None
    if frame is None:
        return None
    file, line, function = frame
    try:
        shown = os.path.relpath(file)
        file = shown if not shown.startswith("..") else file
    except ValueError:
        pass
    worker = failed_worker(error) if worker is None else worker
    where = f" at step {step}" + (f" on worker {worker}" if worker is not None else "") if step is not None else ""
    return UserCodeError(f"{type(error).__name__}: {error_text(error)} ({file}:{line} in {function}){where}")


class WriteError(PstrainError):
    """A write to the run dir failed for a reason the operator can fix (no space, no permission, a
    read-only or vanished file system); the run stops with its last complete checkpoint. The message:
    what, where, the fix."""

    def __init__(self, path: object, what: str = "cannot write", fix: str = "use another --run-dir"):
        super().__init__(f"{what} writing {path}; {fix}")
        self.path = str(path)


class DiskFullError(WriteError):
    """A write failed for want of space."""

    def __init__(self, path: object):
        super().__init__(path, "no space left on device", "free space or use another --run-dir")


# (errno, TensorFlow's wording of it, what, the fix); the first entry is the disk full one.
_WRITE_PROBLEMS = (
    ((errno.ENOSPC, errno.EDQUOT), ("No space left on device", "Disk quota exceeded"), "", ""),
    (
        (errno.EACCES, errno.EPERM),
        ("Permission denied", "Operation not permitted"),
        "permission denied",
        "make it writable (chmod u+w; chattr -i where it is immutable) or use another --run-dir",
    ),
    ((errno.EROFS,), ("Read-only file system",), "read-only file system", "remount it read-write or use another --run-dir"),
    (
        (errno.ENOENT, errno.ESTALE, errno.ENOTCONN, errno.ENODEV),
        ("No such file or directory", "Stale file handle", "Transport endpoint is not connected"),
        "the run dir is gone (unmounted or removed?)",
        "mount it again (then the same command resumes) or use another --run-dir",
    ),
)
_GONE = _WRITE_PROBLEMS[-1]


def write_error(error: BaseException, path: object, gone: bool = True) -> WriteError | None:
    """The operator's version of `error`, raised writing `path`: no space, no permission, a read-only
    file system, or (`gone`) a run dir that vanished; None for anything else. An OSError by its errno,
    a TensorFlow error by its wording ("PATH; Operation not permitted")."""
    if isinstance(error, WriteError):
        return error
    code = error.errno if isinstance(error, OSError) else None
    text = "" if code is not None else str(getattr(error, "message", None) or error)
    for problem in _WRITE_PROBLEMS if gone else _WRITE_PROBLEMS[:-1]:
        codes, words, what, fix = problem
        if code in codes or (code is None and any(word in text for word in words)):
            if not what:
                return DiskFullError(path)
            return WriteError(path, what, fix)
    return None


@contextmanager
def writing(path: object) -> Iterator[None]:
    """Turn a failed write to `path` that the operator can fix (`write_error`) into one WriteError
    naming it; other errors pass."""
    try:
        yield
    except WriteError:
        raise
    except Exception as e:
        found = write_error(e, path)
        if found is None:
            raise
        raise found from e
