"""The `pstrain` command: launch a local cluster, train standalone, or serve as one task."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from cluster import __version__
from cluster.config import Config, ConfigError, load_toml, resolve, with_train
from cluster.rundir import default_run_dir

TRAIN_FLAGS = (
    ("--job", str, "job module: package.module or package.module:attr"),
    ("--steps", int, "training steps (applied updates)"),
    ("--global-batch-size", int, "examples per step, split evenly over the aggregated gradients"),
    ("--replicas-to-aggregate", int, "gradients averaged into each step (default: number of workers)"),
    ("--total-num-replicas", int, "gradients computed per step; more than aggregated = backup workers"),
    ("--seed", int, "seed for initial weights and data order"),
    ("--run-dir", str, "run directory (default runs/<job>-<timestamp>); the same dir resumes"),
    ("--checkpoint-every", int, "checkpoint every K steps (0: only at the end)"),
    ("--startup-timeout", float, "seconds to wait for every TF server to accept connections"),
)


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="cluster config (TOML); flags override it")
    parser.add_argument("--workers", type=int, help="number of workers on --host (free ports)")
    parser.add_argument("--ps", type=int, help="number of ps tasks on --host (free ports)")
    parser.add_argument("--host", help="address for tasks given by count (default 127.0.0.1)")
    for flag, kind, text in TRAIN_FLAGS:
        parser.add_argument(flag, type=kind, help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pstrain", description="Synchronous parameter-server training for TF2.")
    parser.add_argument("--version", action="version", version=f"pstrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="run chief, ps and workers on this machine and train")
    add_common(launch)
    train = sub.add_parser("train", help="train; --standalone runs the same job in one process")
    add_common(train)
    train.add_argument("--standalone", action="store_true", help="one process, no cluster (the reference)")
    sub.add_parser("server", help="serve as the worker or ps task that TF_CONFIG names")
    return parser


def config_from_args(args: argparse.Namespace, gpu_count: int) -> Config:
    raw = load_toml(args.config) if args.config else {}
    overrides = {"workers": args.workers, "ps": args.ps, "host": args.host}
    for flag, _, _ in TRAIN_FLAGS:
        name = flag[2:].replace("-", "_")
        overrides[name] = getattr(args, name)
    config = resolve(raw, overrides, gpu_count=gpu_count)
    check_job_module(config.train.job)
    if not config.train.run_dir:
        config = with_train(config, run_dir=default_run_dir(config.train.job))
    return config


def check_job_module(spec: str) -> None:
    """Fail before any process starts when the job's module cannot be found at all."""
    module = spec.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"train.job: module {module!r} not found; give an importable package.module (is it on PYTHONPATH?)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "server":
        from worker.server import serve

        return serve()
    try:
        if args.command == "train" and args.standalone:
            config = config_from_args(args, gpu_count=0)
            return run_standalone(config)
        from cluster.gpus import gpu_count
        from cluster.launcher import launch

        return launch(config_from_args(args, gpu_count=gpu_count()))
    except ConfigError as e:
        print(f"pstrain: error: {e}", file=sys.stderr)
        return 2


def run_standalone(config: Config) -> int:
    import os

    from cluster import rundir

    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.pop("TF_CONFIG", None)
    run_dir = Path(config.train.run_dir)
    rundir.prepare(run_dir, rundir.describe("standalone", config.train, None), config.train)
    from chief.trainer import main_guarded

    return main_guarded(run_dir, config.train, standalone=True)


if __name__ == "__main__":
    raise SystemExit(main())
