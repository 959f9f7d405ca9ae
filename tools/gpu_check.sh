#!/usr/bin/env bash
# One script for a lent GPU machine (run from the repository root, with a time limit):
#   bash tools/gpu_check.sh [OUT_DIR]
# Sets up what it needs, runs the GPU benchmarks and writes JSON + logs to OUT_DIR (default
# runs/gpu). Each block is independent and guarded by `timeout`, so one slow block cannot eat the
# whole device budget.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu}}
mkdir -p "$OUT"
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
    bash tools/setup.sh > "$OUT/setup.log" 2>&1 || { echo "setup failed, see $OUT/setup.log"; exit 1; }
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
$PY -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name())" | tee "$OUT/torch.txt"

# --- core: detection, bytes, apply and memory at 1B and 7B sizes (issue: core) -----------------
timeout 420 $PY tools/bench_core.py --device cuda --synthetic --sizes 1b 7b --steps 3 \
    --out "$OUT/core_gpu.json" 2>&1 | tee "$OUT/core_gpu.log"
