#!/usr/bin/env bash
# Train on a whole cluster on this machine (chief, ps, workers: separate processes).
# Sets up .venv on first use; every argument goes to `pstrain launch` (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$PSTRAIN_ROOT"
exec pstrain launch "$@"
