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

# --- vLLM (issue 5): VLLMTarget on CUDA parameters, then a real engine with the extension -------
# 1) apply vs vLLM's load_weights on CUDA params of one TP rank, bit-exact check included (models
#    built with the CPU oracle's TP stub, moved to the GPU); needs only tools/setup.sh.
VLLM_TARGET_DEVICE=cpu timeout 300 $PY tools/bench_vllm_apply.py --device cuda --sizes 100m 500m 1b \
    --nnz 1e4 1e5 1e6 1e7 --tp 2 --rank 1 --out "$OUT/vllm_apply_gpu.json" 2>&1 | tee "$OUT/vllm_apply_gpu.log"
# 2) a real LLM (CUDA graphs on) running the deltasync weight-transfer backend, updated with
#    update_llm (staged ahead, committed in place); tokens and vLLM's own weight checksums compared
#    against a fresh engine on the final checkpoint. Needs vLLM's CUDA dependencies (a full `pip install vllm==0.33.0`); skipped with a
#    note when the engine cannot start.
if $PY -c "import vllm, importlib.util as u; assert u.find_spec('vllm._C') or u.find_spec('vllm._C_stable_libtorch')" 2>/dev/null; then
    timeout 420 $PY tools/gpu_vllm_check.py --out "$OUT/vllm_engine.json" --workdir "$OUT/vllm_engine" 2>&1 \
        | tee "$OUT/vllm_engine.log"
else
    echo "vLLM CUDA kernels not installed: engine check skipped" | tee "$OUT/vllm_engine.log"
fi
