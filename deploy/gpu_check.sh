#!/usr/bin/env bash
# Check pstrain on a GPU machine: `pstrain doctor`, a short cluster run with one worker per GPU (at
# most 8; 2 workers sharing the GPU on a 1-GPU machine, the staging case), where TensorFlow placed each
# worker's compute ops, pstrain's throughput against the same job in one process on GPU 0, and the
# tests marked `gpu`. Extra arguments go to both runs (e.g. --steps 300).
# Exit 2 (one line) where no GPU is found, 1 where a check fails.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ "${gpus:-0}" -eq 0 ]; then
  echo "pstrain: error: gpu_check: no NVIDIA GPU found (nvidia-smi -L lists none); run it on a machine with a GPU and its driver" >&2
  exit 2
fi
source "$root/deploy/bootstrap.sh"
cd "$PSTRAIN_ROOT"
workers=$(( gpus < 2 ? 2 : (gpus < 8 ? gpus : 8) ))  # worker_gpus "auto": shared round-robin
out=runs/gpu-check-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
config=$out/cluster.toml
printf '[cluster]\nworkers = %d\n[train]\nsteps = 100\nglobal_batch_size = %d\n' "$workers" $(( 64 * workers )) > "$config"
echo "pstrain: gpu_check: $gpus GPU(s), $workers workers; results in $out"
if ! pstrain doctor --config "$config"; then
  echo "pstrain: error: gpu_check: pstrain doctor reports a FAIL (above); fix it first" >&2
  exit 1
fi
PSTRAIN_LOG_DEVICE_PLACEMENT=1 pstrain launch --config "$config" --run-dir "$out/cluster" "$@"
CUDA_VISIBLE_DEVICES=0 pstrain train --standalone --config "$config" --run-dir "$out/standalone" "$@"
python -m cluster.doctor.gpu_check "$out/cluster" "$out/standalone"
exec python -m pytest -q -m gpu tests/
