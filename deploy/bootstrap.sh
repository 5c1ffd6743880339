#!/usr/bin/env bash
# Create (or refresh) the virtual environment with pinned dependencies, and put its bin/ (with the
# `pstrain` command) first on PATH. Source it in your shell (`source deploy/bootstrap.sh`) or from a
# script; does nothing when .venv is already up to date. PSTRAIN_VENV and PYTHON override the defaults.
#
# Safe to source: it sets PSTRAIN_ROOT, PSTRAIN_VENV and PATH and nothing else. The set-up runs in a
# subshell with its own `set -euo pipefail`, so the caller's shell options stay as they were, and a
# failure returns its status (a script that sourced it with `set -e` stops; an interactive shell lives).
PSTRAIN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PSTRAIN_VENV=${PSTRAIN_VENV:-$PSTRAIN_ROOT/.venv}

(
  set -euo pipefail
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    tensorflow='tensorflow[and-cuda]==2.21.0'
  else
    tensorflow='tensorflow-cpu==2.21.0'
  fi
  want=$(cat "$PSTRAIN_ROOT/deploy/requirements.txt" "$PSTRAIN_ROOT/setup.cfg" | sha256sum | cut -c1-16)-$tensorflow
  stamp=$PSTRAIN_VENV/.pstrain-bootstrap

  if [ ! -x "$PSTRAIN_VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    python=${PYTHON:-python3}
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      echo "pstrain: error: $python is not a Python 3.11 or newer; set PYTHON to one" >&2
      exit 2
    fi
    echo "pstrain: setting up $PSTRAIN_VENV with $tensorflow (one time, a few minutes)" >&2
    "$python" -m venv "$PSTRAIN_VENV"
    pip=("$PSTRAIN_VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
    "${pip[@]}" --upgrade pip
    "${pip[@]}" "$tensorflow" -r "$PSTRAIN_ROOT/deploy/requirements.txt"
    # tf_keras asks for the "tensorflow" distribution; tensorflow-cpu provides the same package, so
    # skip its dependency check rather than download a second TensorFlow (deploy/install_extra.sh
    # installs the optional extras the same way).
    "${pip[@]}" --no-deps tf_keras==2.21.0
    "${pip[@]}" --no-deps --no-build-isolation -e "$PSTRAIN_ROOT"
    echo "$want" > "$stamp"
  fi
)
_pstrain_status=$?
if [ "$_pstrain_status" != 0 ]; then
  return "$_pstrain_status" 2>/dev/null || exit "$_pstrain_status"  # `return` when sourced, else `exit`
fi
unset _pstrain_status
case ":$PATH:" in
  *":$PSTRAIN_VENV/bin:"*) ;;
  *) export PATH=$PSTRAIN_VENV/bin:$PATH ;;
esac
