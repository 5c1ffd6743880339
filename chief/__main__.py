"""`python -m chief --run-dir DIR`: the coordinator process the launcher starts (TF_CONFIG from env)."""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from cluster.rundir import RunDir  # noqa: E402
from cluster.stop import StopTrap  # noqa: E402
from cluster.taskenv import Switches, TaskEnv, die_with_parent  # noqa: E402

die_with_parent()
parser = argparse.ArgumentParser(prog="python -m chief")
parser.add_argument("--run-dir", required=True, type=Path)
args = parser.parse_args()
with StopTrap() as stop:  # before TensorFlow's import: a stop during start-up ends it, said in one line
    from chief.trainer import main_guarded

    switches = Switches.from_env()  # this process's environment, read here once and passed on
    if switches.log_device_placement:
        import tensorflow as tf

        tf.debugging.set_log_device_placement(True)
    run_dir = RunDir(args.run_dir)  # the one layout every reader and writer of the run takes its paths from
    code = main_guarded(run_dir, run_dir.train(), False, TaskEnv.from_env(), switches, stop=stop)
# Everything is written and flushed by now. Leave without Python's shutdown: ClusterCoordinator's
# threads may still wait on RPCs to an unreachable worker and would hold the exit for minutes.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
