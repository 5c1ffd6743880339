#!/usr/bin/env bash
# Lint, then the test suite tier by tier, cheapest first (docs/testing.md): pure, inprocess (TF servers in
# the test process), cluster (real processes), netns (network namespaces). A failing tier ends the run, so
# a broken import fails within the first minute. Sets up .venv on first use; extra arguments go to every
# pytest run, except that given a -m of your own, one pytest run takes your arguments as they are.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$PSTRAIN_ROOT"
# The Ray engine's tests need the optional extra (setup.cfg `ray`); `deploy/start_local.sh` does not.
python -c 'import ray' 2>/dev/null || bash deploy/install_ray.sh  # keeps the one TensorFlow (docs/ray.md)
ruff check .
ruff format --check .
filtered=0  # a -k of the caller's may leave a tier with nothing to run (pytest's exit 5); without one, that is an error
for arg in "$@"; do
  case "$arg" in
    -m | -m?* | --markexpr*) exec python -m pytest tests "$@" ;;
    -k | -k?* | --keyword*) filtered=1 ;;
  esac
done
# Every tier but netns runs in 2 processes (pytest-xdist): pure and inprocess spread their tests (each process
# makes its own in-process cluster), cluster spreads its files (one file per process at a time: a file
# shares its clusters between its tests); cluster tests wait on processes and timeouts for about a third
# of their time, so 2 cores overlap them. PSTRAIN_TEST_WORKERS=0 runs each tier in one process. Each test
# still starts its own cluster on free ports, and reaps it.
workers="${PSTRAIN_TEST_WORKERS:-2}"
for tier in pure inprocess cluster netns; do
  echo "pstrain: tests of tier $tier"
  code=0
  if [ "$tier" = cluster ] && [ "$workers" != 0 ]; then
    # Tests that measure time (marker `alone`) run after the rest, in one process, with nothing beside them.
    python -m pytest tests -m "$tier and not alone" -n "$workers" --dist loadfile "$@" || code=$?
    if [ "$code" = 0 ] || [ "$code" = 5 ]; then
      later=0
      python -m pytest tests -m "$tier and alone" "$@" || later=$?
      if [ "$later" != 5 ]; then code=$later; fi
    fi
  elif [ "$tier" != netns ] && [ "$workers" != 0 ]; then
    python -m pytest tests -m "$tier" -n "$workers" --dist load "$@" || code=$?
  else
    python -m pytest tests -m "$tier" "$@" || code=$?
  fi
  if [ "$code" = 5 ] && [ "$filtered" = 0 ]; then
    echo "pstrain: error: no test of tier $tier was collected (pytest exit 5); later tiers not run" >&2
    exit 5
  fi
  if [ "$code" != 0 ] && [ "$code" != 5 ]; then  # 5 here: no test of this tier selected by the -k given
    echo "pstrain: error: tests of tier $tier failed (exit $code); later tiers not run" >&2
    exit "$code"
  fi
done
