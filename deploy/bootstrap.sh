#!/usr/bin/env bash
# Create (or refresh) the virtual environment with pinned dependencies. Sourced by the other scripts;
# does nothing when .venv is already up to date. PSTRAIN_VENV and PYTHON override the defaults.
set -euo pipefail
PSTRAIN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PSTRAIN_VENV=${PSTRAIN_VENV:-$PSTRAIN_ROOT/.venv}

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
    echo "pstrain: error: $python is older than Python 3.11; set PYTHON to a newer interpreter" >&2
    exit 2
  fi
  echo "pstrain: setting up $PSTRAIN_VENV with $tensorflow (one time, a few minutes)" >&2
  "$python" -m venv "$PSTRAIN_VENV"
  pip=("$PSTRAIN_VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  "${pip[@]}" "$tensorflow" -r "$PSTRAIN_ROOT/deploy/requirements.txt"
  # tf_keras asks for the "tensorflow" distribution; tensorflow-cpu provides the same package, so
  # skip its dependency check rather than download a second TensorFlow.
  "${pip[@]}" --no-deps tf_keras==2.21.0
  "${pip[@]}" --no-deps --no-build-isolation -e "$PSTRAIN_ROOT"
  echo "$want" > "$stamp"
fi
export PATH=$PSTRAIN_VENV/bin:$PATH
