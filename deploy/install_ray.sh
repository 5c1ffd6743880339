#!/usr/bin/env bash
# Install the Ray extra (the `ray` pin of setup.cfg) into pstrain's venv without touching what is
# there: `pip install .[ray]` would pull the full `tensorflow` (tf_keras depends on that name) beside
# tensorflow-cpu and replace the editable install of pstrain with a copy. Here pip installs Ray alone,
# constrained to every version the venv already has (`pip freeze`), so exactly one TensorFlow and the
# editable pstrain stay; a Ray that needs another version of one of them is refused by pip, not installed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
ray_pin=$(sed -n 's/^ray = //p' "$PSTRAIN_ROOT/setup.cfg")
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PSTRAIN_VENV/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check | grep -v " @ " >"$constraints"
"$PSTRAIN_VENV/bin/python" -m pip install --quiet --disable-pip-version-check --constraint "$constraints" "$ray_pin"
echo "pstrain: installed $ray_pin into $PSTRAIN_VENV (TensorFlow and the editable pstrain kept); check with: pstrain doctor"
