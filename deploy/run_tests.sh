#!/usr/bin/env bash
# Lint and run the whole test suite (real processes, a real TF cluster on loopback).
# Sets up .venv on first use; extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$PSTRAIN_ROOT"
ruff check .
ruff format --check .
exec python -m pytest tests "$@"
