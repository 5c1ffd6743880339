#!/usr/bin/env bash
# Train on a whole cluster on this machine (chief, ps, workers: separate processes).
# Sets up .venv on first use; every argument goes to `pstrain launch` (see --help). Runs where it is
# called: a job module in the working directory imports, and relative paths are taken from there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec pstrain launch "$@"
