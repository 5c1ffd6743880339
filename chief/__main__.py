"""`python -m chief --run-dir DIR`: the coordinator process the launcher starts (TF_CONFIG from env)."""

import argparse
import os
from pathlib import Path

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from chief.trainer import main_guarded
from cluster.rundir import load_train

parser = argparse.ArgumentParser(prog="python -m chief")
parser.add_argument("--run-dir", required=True, type=Path)
args = parser.parse_args()
raise SystemExit(main_guarded(args.run_dir, load_train(args.run_dir), standalone=False))
