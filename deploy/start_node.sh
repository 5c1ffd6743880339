#!/usr/bin/env bash
# Run this machine's share of a cluster whose chief runs elsewhere:
#   deploy/start_node.sh --chief HOST:PORT --token-file FILE    (ask the chief for this machine's tasks)
#   deploy/start_node.sh --config cluster.toml                   (the tasks the shared config puts here)
# Sets up .venv on first use; every argument goes to `pstrain node`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec pstrain node "$@"
