"""`pstrain status` and `pstrain stop`: find a running chief's control plane (by its run dir's
control.json, or by --chief and --token-file) and call it."""

from __future__ import annotations

import json
import socket
import time
from argparse import Namespace
from dataclasses import dataclass

from cluster.config import ConfigError
from cluster.control.security import Credentials, load_token
from cluster.doors import check_control_target
from cluster.rundir import ControlRecord, RunDir, latest_step, read_control


@dataclass(frozen=True)
class Target:
    """A control plane to call: its gRPC target, the credentials, and the run dir where it was found."""

    address: str  # "HOST:PORT" or "unix:PATH"
    creds: Credentials
    run_dir: RunDir | None = None


def record_credentials(record: ControlRecord, run_dir: RunDir, token_file: str, tls_ca: str) -> Credentials:
    """The credentials for a run's control plane: flags win, then what control.json names (a relative
    token file: in the run dir)."""
    if not (token_file or record.token_file):
        try:
            return Credentials(load_token(), tls_ca=tls_ca or record.tls_ca)
        except ConfigError:
            raise ConfigError(
                "--token-file: the run's token came from $PSTRAIN_TOKEN in the shell that launched it; "
                "set PSTRAIN_TOKEN to it here, or pass --token-file"
            ) from None
    return Credentials(load_token(token_file or str(run_dir.token_file(record))), tls_ca=tls_ca or record.tls_ca)


def target_of(args: Namespace) -> Target:
    """Where `--run-dir DIR` (its control.json) or `--chief HOST:PORT` (with --token-file or
    $PSTRAIN_TOKEN) says the control plane is; ConfigError (one line) unless exactly one is given.
    `args.run_dir`: the RunDir the command line built, or None."""
    run_dir, chief = getattr(args, "run_dir", None), getattr(args, "chief", None)
    if run_dir and chief:
        raise ConfigError(f"pstrain {args.command}: give --run-dir DIR or --chief HOST:PORT, not both")
    if not (run_dir or chief):
        raise ConfigError(
            f"pstrain {args.command}: give --run-dir DIR (the run's directory), or --chief HOST:PORT with --token-file"
        )
    if run_dir:
        record = read_control(run_dir)
        creds = record_credentials(record, run_dir, args.token_file, args.tls_ca)
        return Target(record.target, creds, run_dir)
    check_control_target("--chief", chief)
    return Target(chief, Credentials(load_token(args.token_file), tls_ca=args.tls_ca))


def doctor_target(args: Namespace) -> Target | None:
    """The running cluster `pstrain doctor` also checks: --chief's, else the one --run-dir's control.json
    names (a run dir alone may also be given for its doors: then its record must exist); None for neither."""
    if args.chief:
        return target_of(Namespace(**{**vars(args), "run_dir": None}))
    return target_of(args) if args.run_dir else None


def freshest_step(status: dict, run_dir: RunDir | None, now: float | None = None) -> dict:
    """`status` with its step the newest known: the chief's report, or the run's metrics.jsonl where
    that has a later step; `step_age_s` says how old it is (-1: unknown). Pure but for the file read."""
    now = time.time() if now is None else now
    found = latest_step(run_dir) if run_dir else None
    if found and found[0] > status.get("step", 0):
        return {**status, "step": found[0], "step_age_s": round(max(0.0, now - found[1]), 3), "step_from": "metrics.jsonl"}
    return status


def control_call(args: Namespace) -> int:
    """`pstrain status` / `pstrain stop` against a running chief."""
    import grpc

    from cluster.control.proto import control_pb2 as pb
    from cluster.control.service import RPC_TIMEOUT_S, status_dict, stub
    from cluster.control.status_table import format_status

    target = target_of(args)
    control = stub(target.address, target.creds)
    try:
        if args.command == "stop":
            control.Stop(pb.StopRequest(reason=f"pstrain stop from {socket.gethostname()}"), timeout=RPC_TIMEOUT_S)
            print(f"pstrain: stop requested; the chief at {target.address} checkpoints and stops the cluster")
            return 0
        status = status_dict(control.Status(pb.StatusRequest(), timeout=RPC_TIMEOUT_S))
    except grpc.RpcError as e:
        flag = "--run-dir" if target.run_dir else "--chief"
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise ConfigError(f"--token-file: the chief at {target.address} refused the token; use the cluster's token") from None
        found = f"no control plane answers at {target.address} ({e.code().name})"
        raise ConfigError(f"{flag}: {found}; is the cluster running?") from None
    status = freshest_step(status, target.run_dir)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0
