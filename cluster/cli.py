"""The `pstrain` command: launch a local cluster, train standalone, or serve as one task."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

# Before grpc loads: the launcher forks tasks while its control-plane threads run. gRPC's fork
# support would restart its poller in the child between fork() and exec(), where closing inherited
# descriptors then aborts it (seen as tasks dying with SIGABRT at start); tasks never need it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from cluster import __version__
from cluster.config import (
    DEFAULT_HOST,
    ClusterConfig,
    Config,
    TrainConfig,
    check_job_module,
    every_flag,
    load_toml,
    resolve,
    with_train,
)
from cluster.control.security import Credentials, load_token
from cluster.errors import ConfigError, PstrainError, report, signal_exit_code
from cluster.rundir import RunDir, default_run_dir
from cluster.slurm import PORT_BASE
from cluster.taskenv import DEFAULT_CONTROL_PORT, Switches, TaskEnv
from cluster.tfconfig import forget_tf_config, named_task_type, tf_config_text

TRAIN_FLAGS = (
    ("--job", str, "job module: package.module or package.module:attr"),
    ("--steps", int, "training steps (applied updates)"),
    ("--epochs", int, "passes over the training set, as Keras's fit(epochs=N); instead of --steps"),
    ("--global-batch-size", int, "examples per step, split evenly over the aggregated gradients"),
    ("--replicas-to-aggregate", int, "gradients averaged into each step (default: number of workers)"),
    ("--total-num-replicas", int, "gradients computed per step; more than aggregated = backup workers"),
    ("--seed", int, "seed for initial weights and data order"),
    ("--run-dir", str, "run directory (default runs/<job>-<timestamp>); the same dir resumes"),
    ("--checkpoint-every", every_flag, "checkpoint every K steps (0: only at the end), or 'epoch'"),
    ("--eval-every", every_flag, "evaluate on the job's eval_data every K steps (0: only at the end), or 'epoch'"),
    ("--startup-timeout", float, "seconds to wait for every TF server to accept connections"),
    ("--shuffle", str, "data order: permutation (default) or index_shuffle (stateless, for very large data sets)"),
    ("--steps-per-execution", int, "steps each worker runs per dispatch from the chief (default 64; 1: one per step)"),
    ("--on-nonfinite", str, "a NaN/Inf loss or mean gradient: stop (default: checkpoint and exit) or skip the step"),
    ("--dense", str, "dense variables: ps (default: updated on the ps) or allreduce (replicated on the workers)"),
)


CHIEF_HELP = "the chief's control plane: HOST:PORT, or unix:PATH (a local cluster's; the launch prints it)"
ALLOW_HELP = "run even where the TF ports cannot be closed to outsiders (recorded in cluster.json; README: Security)"
NO_NETNS_HELP = "a local cluster's tasks on this machine's network, TF ports open (with --allow-open-ports; in cluster.json)"


class Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake said in one line (exit 2) instead of the usage block."""

    def error(self, message: str):
        where = "" if self.prog == "pstrain" else f"{self.prog}: "  # a subcommand's mistake names it
        self.exit(2, f"pstrain: error: {where}{message}; see {self.prog} --help\n")


class DefaultsFormatter(argparse.HelpFormatter):
    """--help says each flag's default where it has one and the text does not already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, "", argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def with_default(text: str, name: str) -> str:
    """A config-backed flag's help with the config's default (the flag's own default is None: unset)."""
    if "default" in text:
        return text
    value = getattr(TrainConfig(), name, None)
    return f"{text} (default: {value})" if value not in (None, "") else text


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every command's --help with the defaults (`DefaultsFormatter`), subcommands' included."""
    parser.formatter_class = DefaultsFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                show_defaults(command)


def add_common(parser: argparse.ArgumentParser) -> None:
    cluster = ClusterConfig()
    parser.add_argument("--config", help="cluster config (TOML); flags override it")
    parser.add_argument("--workers", type=int, help=f"number of workers on --host (free ports; default: {len(cluster.workers)})")
    parser.add_argument("--ps", type=int, help=f"number of ps tasks on --host (free ports; default: {len(cluster.ps)})")
    parser.add_argument("--host", help=f"address for tasks given by count (default: {DEFAULT_HOST})")
    parser.add_argument("--allow-open-ports", action="store_true", default=None, help=ALLOW_HELP)
    parser.add_argument("--no-private-network", dest="private_network", action="store_false", default=None, help=NO_NETNS_HELP)
    for flag, kind, text in TRAIN_FLAGS:
        parser.add_argument(flag, type=kind, help=with_default(text, flag[2:].replace("-", "_")))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pstrain", description="Synchronous parameter-server training for TF2.")
    parser.add_argument("--version", action="version", version=f"pstrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="run chief, ps and workers on this machine and train")
    add_common(launch)
    launch.add_argument("--engine", choices=("local", "ray"), help="who places the tasks: local (default) or ray (docs/ray.md)")
    ray_help = "with --engine ray: auto or HOST:PORT of a Ray cluster (default: start one on 127.0.0.1)"
    launch.add_argument("--address", dest="ray_address", help=ray_help)
    spread_help = "with --engine ray: each worker on a node of its own"
    launch.add_argument("--spread-workers", action="store_true", default=None, help=spread_help)
    train = sub.add_parser("train", help="train; --standalone runs the same job in one process")
    add_common(train)
    train.add_argument("--standalone", action="store_true", help="one process, no cluster (the reference)")
    server = sub.add_parser("server", help="serve as the worker or ps task that TF_CONFIG names")
    server.add_argument("--run-dir", default="", help="for an `evaluator` task: the run to evaluate (else $PSTRAIN_RUN_DIR)")
    node = sub.add_parser("node", help="run this machine's tasks of a cluster whose chief runs elsewhere")
    node.add_argument("--config", help="the shared cluster config; this machine runs the tasks on its addresses")
    node.add_argument("--chief", help="HOST:PORT of the chief's control plane; ask it for this machine's tasks")
    node.add_argument("--log-dir", default="", help="task logs (default runs/node-<timestamp>/logs)")
    node.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the chief to answer")
    node.add_argument("--slurm", action="store_true", help="this node's tasks from SLURM_* (one per node under srun)")
    node.add_argument("--port-base", type=int, default=PORT_BASE, help="with --slurm: chief port; control +1, tasks above")
    node.add_argument("--allow-open-ports", action="store_true", help=ALLOW_HELP)
    add_control_flags(node)
    add_deploy_commands(sub)
    from cluster.forecast.command import add_plan_parser

    add_plan_parser(sub)
    evaluate = sub.add_parser("evaluate", help="sidecar evaluator: evaluate each new checkpoint of a run until it is done")
    evaluate.add_argument("run_dir", type=Path, help="the run directory (its --run-dir)")
    evaluate.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds without a done line")
    evaluate.add_argument("--poll", type=float, default=1.0, help="seconds between looks for new checkpoints")
    for name, text in (
        ("status", "show the cluster: tasks, heartbeats, step, gradients"),
        ("stop", "checkpoint and stop the cluster"),
    ):
        command = sub.add_parser(name, help=text)
        add_target_flags(command)
        if name == "status":
            command.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("plot", help="write PNGs of a run to RUN_DIR/plots/").add_argument("run_dir", metavar="RUN_DIR")
    doctor = sub.add_parser("doctor", help="check this machine (GPUs, drivers, ports, hosts) and a running cluster")
    doctor.add_argument("--config", help="the cluster config to check against (default: the defaults)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    add_target_flags(doctor, "also check a running cluster: versions, clock, round trips")
    show_defaults(parser)
    return parser


def add_deploy_commands(sub) -> None:
    """`pstrain task` (every pod of a TFJob) and `pstrain render tfjob|slurm`."""
    task = sub.add_parser("task", help="serve the role (chief, ps or worker) that an injected TF_CONFIG names")
    task.add_argument("--config", default="", help="the pod config (counts, heartbeats, [train]); addresses come from TF_CONFIG")
    task.add_argument("--control-port", type=int, default=DEFAULT_CONTROL_PORT, help="the control plane's port on the chief")
    render = sub.add_parser("render", help="write a deployment for Kubernetes (TFJob) or Slurm (sbatch)")
    kinds = render.add_subparsers(dest="kind", required=True)
    tfjob = kinds.add_parser("tfjob", help="a Kubeflow TFJob (kubeflow.org/v1) and its ConfigMap")
    tfjob.add_argument("--image", required=True, help="container image with pstrain installed")
    tfjob.add_argument("--name", default="pstrain", help="TFJob name (DNS-1035)")
    tfjob.add_argument("--namespace", default="default")
    tfjob.add_argument("--token-secret", default="", help="Secret with key 'token' (default NAME-token)")
    tfjob.add_argument("--run-dir-claim", default="", help="PersistentVolumeClaim for the chief's run dir (default NAME-runs)")
    tfjob.add_argument("--control-port", type=int, default=DEFAULT_CONTROL_PORT, help="the control plane's container port")
    tfjob.add_argument("--worker-gpus", dest="gpus_per_pod", type=int, default=1, help="nvidia.com/gpu per worker pod (0: CPU)")
    tfjob.add_argument("--status-from", default="", help="KEY=VALUE: pods with this label may reach the control port too")
    slurm = kinds.add_parser("slurm", help="an sbatch script: one pstrain node --slurm per node")
    slurm.add_argument("--nodes", type=int, default=0, help="nodes (default: workers / GPUs per node)")
    slurm.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (0: CPU)")
    slurm.add_argument("--time", default="01:00:00", help="time limit; the run checkpoints 120 s before it")
    slurm.add_argument("--partition", default="")
    slurm.add_argument("--job-name", default="pstrain")
    slurm.add_argument("--port-base", type=int, default=PORT_BASE, help="chief port; control +1, ps and workers above")
    for command in (tfjob, slurm):
        command.add_argument("--config", required=True, help="the cluster config (TOML)")
        command.add_argument("--output", "-o", default="", help="file to write (default: standard output)")


def run_render(args: argparse.Namespace) -> int:
    from cluster.render import write_output

    raw = load_toml(args.config)
    cluster_raw = {k: v for k, v in dict(raw.get("cluster", {})).items() if k != "worker_gpus"}  # GPUs: the scheduler's
    config = resolve({**raw, "cluster": cluster_raw})
    if args.kind == "tfjob":
        from cluster.render.tfjob import TFJobOptions, render_tfjob, to_yaml

        options = TFJobOptions(
            args.image,
            args.name,
            args.namespace,
            args.token_secret,
            args.run_dir_claim,
            args.control_port,
            args.gpus_per_pod,
            args.status_from,
        )
        text = to_yaml(render_tfjob(config, options))
    else:
        from cluster.render.sbatch import SlurmOptions, render_sbatch

        path = str(Path(args.config).resolve())
        options = SlurmOptions(path, args.nodes, args.gpus_per_node, args.time, args.partition, args.job_name, args.port_base)
        text = render_sbatch(config, options)
    write_output(text, args.output)
    return 0


def add_target_flags(parser: argparse.ArgumentParser, what: str = "") -> None:
    """--run-dir DIR (a running launch's directory: its control.json names the control plane and token),
    or --chief HOST:PORT with --token-file, for a chief seen from another machine."""
    lead = f"{what}: " if what else ""
    parser.add_argument("--run-dir", help=f"{lead}the run directory of a running pstrain launch (its control.json)")
    parser.add_argument("--chief", help=f"{lead}{CHIEF_HELP.removeprefix('the ')} (from another machine: with --token-file)")
    add_control_flags(parser)


def add_control_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", default="", help="the control-plane token (else $PSTRAIN_TOKEN)")
    parser.add_argument("--tls-ca", default="", help="PEM CA certificate when the control plane uses TLS")


def control_credentials(args: argparse.Namespace, cluster=None) -> Credentials:
    token_file = args.token_file or (cluster.token_file if cluster else "")
    tls_ca = args.tls_ca or (cluster.tls_ca or cluster.tls_cert if cluster else "")
    return Credentials(load_token(token_file), tls_ca=tls_ca)


def run_node_command(args: argparse.Namespace) -> int:
    import time

    from cluster.launch.node import node_cluster, node_env, run_node

    if bool(args.config) == bool(args.chief):
        raise ConfigError("pstrain node: give exactly one of --config FILE or --chief HOST:PORT")
    config = resolve(load_toml(args.config)) if args.config else None
    creds = control_credentials(args, config.cluster if config else None)
    cluster, tasks = node_cluster(config.cluster if config else None, args.chief, creds, args.timeout)
    if args.allow_open_ports:
        cluster = replace(cluster, allow_open_ports=True)
    log_dir = Path(args.log_dir or f"runs/node-{time.strftime('%Y%m%d-%H%M%S')}/logs")
    return run_node(cluster, tasks, node_env(config, cluster, creds), log_dir)


def config_from_args(args: argparse.Namespace, gpu_count: int) -> Config:
    raw = load_toml(args.config) if args.config else {}
    overrides = {"workers": args.workers, "ps": args.ps, "host": args.host, "allow_open_ports": args.allow_open_ports}
    overrides["private_network"] = args.private_network
    for name in ("engine", "ray_address", "spread_workers"):  # `pstrain launch` only
        overrides[name] = getattr(args, name, None)
    for flag, _, _ in TRAIN_FLAGS:
        name = flag[2:].replace("-", "_")
        overrides[name] = getattr(args, name)
    config = resolve(raw, overrides, gpu_count=gpu_count)
    check_job_module(config.train.job)
    if not config.train.run_dir:
        config = with_train(config, run_dir=default_run_dir(config.train.job))
    return config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # jobs in the working directory import, as under `python -m`
    try:
        if args.command == "server":
            evaluator = evaluator_run_dir(args.run_dir)
            if evaluator is not None:
                return run_evaluate(argparse.Namespace(run_dir=evaluator, timeout=EVALUATOR_TIMEOUT_S, poll=5.0))
            from worker.server import serve

            return serve()
        if args.command in ("status", "stop", "doctor") and args.run_dir:
            args.run_dir = RunDir(args.run_dir)  # the run's one layout, for the control plane's client and the doctor
        if args.command in ("status", "stop"):
            from cluster.control.client import control_call

            return control_call(args)
        if args.command == "node" and args.slurm:
            from cluster.launch.slurm_node import run_slurm_node, slurm_config

            if not args.config:
                raise ConfigError("pstrain node --slurm: give --config FILE (the job's config, on every node)")
            config, local_tasks, runs_chief = slurm_config(load_toml(args.config), os.environ, args.port_base)
            return run_slurm_node(config, RunDir(config.train.run_dir), local_tasks, runs_chief)
        if args.command == "node":
            return run_node_command(args)
        if args.command == "doctor":
            from cluster.control.client import doctor_target
            from cluster.doctor.run import doctor

            target = doctor_target(args)
            chief, creds = (target.address, target.creds) if target else (None, None)
            return doctor(args.config, chief, creds, args.json, args.run_dir or None)
        if args.command == "plot":
            from chief.plots import render

            print("\n".join(f"pstrain: wrote {p}" for p in render(RunDir(args.run_dir))))
            return 0
        if args.command == "task":
            from cluster.launch.pod import pod_env, run_task

            config, task_type, env = pod_env(load_toml(args.config) if args.config else {}, os.environ, args.control_port)
            return run_task(config, task_type, env, RunDir(config.train.run_dir), args.config)
        if args.command == "render":
            return run_render(args)
        if args.command == "plan":
            from cluster.forecast.command import run_plan

            return run_plan(args)
        if args.command == "evaluate":
            return run_evaluate(args)
        if args.command == "train" and args.standalone:
            config = config_from_args(args, gpu_count=0)
            return run_standalone(config)
        from cluster.launch.gpu_count import gpu_count
        from cluster.launch.launcher import launch

        config = config_from_args(args, gpu_count=gpu_count())
        layout = RunDir(config.train.run_dir)  # the run's one layout, passed down from here
        if config.cluster.engine == "ray":
            from cluster.launch.ray_engine import launch_ray

            return launch_ray(config, layout)
        return launch(config, layout)
    except PstrainError as e:
        return report(e)
    except KeyboardInterrupt:  # Ctrl-C before a command's own stop trap is in place
        print("pstrain: stopped by Ctrl-C during start-up, before anything started; run the same command again", flush=True)
        return signal_exit_code(signal.SIGINT)


EVALUATOR_TIMEOUT_S = 7 * 24 * 3600.0  # an evaluator task gives up on a run that never finishes after a week


def evaluator_run_dir(flag: str) -> Path | None:
    """For a TF_CONFIG `evaluator` task (Kubeflow's Evaluator replica): the run dir it follows; None otherwise."""
    if named_task_type(tf_config_text()) != "evaluator":
        return None  # (the server reports a bad TF_CONFIG itself)
    run_dir = flag or Switches.from_env().run_dir
    if not run_dir:
        raise ConfigError(
            "pstrain server: TF_CONFIG task type 'evaluator' evaluates a run's checkpoints; "
            "give it the run directory with --run-dir or $PSTRAIN_RUN_DIR (a volume shared with the chief)"
        )
    return Path(run_dir)


def run_evaluate(args: argparse.Namespace) -> int:
    """`pstrain evaluate RUN_DIR`: follow the run's checkpoints (chief/sidecar.py)."""
    from contextlib import nullcontext

    from cluster.native_log import native_stderr_to

    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    forget_tf_config()
    run_dir = RunDir(args.run_dir)  # the run's one layout, passed down from here
    with native_stderr_to(run_dir.log("evaluate")) if run_dir.logs.is_dir() else nullcontext():  # TensorFlow's C++ lines
        from chief.sidecar import follow

        return follow(run_dir, timeout_s=args.timeout, poll_s=args.poll)


def run_standalone(config: Config) -> int:
    from cluster import rundir

    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    forget_tf_config()
    from cluster.errors import writing
    from cluster.native_log import native_stderr_to
    from cluster.preflight import check_writable
    from cluster.runlock import RunDirLock
    from cluster.stop import StopTrap

    run_dir = RunDir(config.train.run_dir)  # the run's one layout, passed down from here
    check_writable(run_dir)
    with RunDirLock(run_dir, "pstrain train --standalone"), StopTrap() as stop:  # a stop during imports counts
        with writing(run_dir.path):
            rundir.prepare(run_dir, rundir.describe("standalone", config.train, None), config.train)
        with native_stderr_to(run_dir.log("standalone")):  # TensorFlow's C++ start-up lines: the log, not the console
            from chief.trainer import main_guarded

            task_env, switches = TaskEnv.from_env(), Switches.from_env()
            return main_guarded(run_dir, config.train, True, task_env, switches, stop=stop)


if __name__ == "__main__":
    raise SystemExit(main())
