#!/usr/bin/env bash
# Lint, then the test suite tier by tier, cheapest first (docs/testing.md): pure, inprocess (TF servers in
# the test process), cluster (real processes), netns (network namespaces). A failing tier ends the run, so
# a broken import fails within the first minute. Sets up .venv on first use; extra arguments go to every
# pytest run, except that given a -m of your own, one pytest run takes your arguments as they are.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$PSTRAIN_ROOT"
# The Ray engine's tests need the optional extra (setup.cfg `ray`); `deploy/start_local.sh` does not.
ray_pin=$(sed -n 's/^ray = //p' setup.cfg)
python -c 'import ray' 2>/dev/null || python -m pip install --quiet --disable-pip-version-check "$ray_pin"
ruff check .
ruff format --check .
for arg in "$@"; do
  case "$arg" in -m | -m?* | --markexpr*) exec python -m pytest tests "$@" ;; esac
done
for tier in pure inprocess cluster netns; do
  echo "pstrain: tests of tier $tier"
  code=0
  python -m pytest tests -m "$tier" "$@" || code=$?
  if [ "$code" != 0 ] && [ "$code" != 5 ]; then  # 5: no test of this tier selected (e.g. by -k)
    echo "pstrain: error: tests of tier $tier failed (exit $code); later tiers not run" >&2
    exit "$code"
  fi
done
