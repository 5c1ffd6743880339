"""`python -m chief --run-dir DIR`: the coordinator process the launcher starts (TF_CONFIG from env)."""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from cluster.stop import StopTrap  # noqa: E402
from cluster.taskenv import die_with_parent  # noqa: E402

die_with_parent()
parser = argparse.ArgumentParser(prog="python -m chief")
parser.add_argument("--run-dir", required=True, type=Path)
args = parser.parse_args()
with StopTrap() as stop:  # before TensorFlow's import: a stop during start-up ends it, said in one line
    from chief.trainer import main_guarded
    from cluster.rundir import load_train

    if os.environ.get("PSTRAIN_LOG_DEVICE_PLACEMENT") == "1":
        import tensorflow as tf

        tf.debugging.set_log_device_placement(True)
    code = main_guarded(args.run_dir, load_train(args.run_dir), standalone=False, stop=stop)
# Everything is written and flushed by now. Leave without Python's shutdown: ClusterCoordinator's
# threads may still wait on RPCs to an unreachable worker and would hold the exit for minutes.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
