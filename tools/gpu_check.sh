#!/usr/bin/env bash
# The GPU checks of issue 14, as one run on a lent GPU machine (from the repository root):
#   bash tools/gpu_check.sh [OUT_DIR]            # on the GPU machine; default OUT_DIR: $OUT or runs/gpu
#   bash tools/gpu_check.sh --smoke [OUT_DIR]    # here, on the CPU: the same blocks at toy sizes
#
# A lent machine has no network, no .venv and about 15 minutes of device time per session, its
# start included. So this script:
# * runs on the image's own python3 (PyTorch, Triton, numba, safetensors, transformers) with this
#   checkout on PYTHONPATH, and installs the wheels carried in .whl/ (the packages the image lacks:
#   prepare them here with `bash tools/gpu_wheels.sh`, then carry ".whl"); .venv/bin/python when
#   tools/setup.sh made one;
# * checks first that torch_deltasync imports and the GPU is seen, and stops there with the reason
#   (a numba that does not import is reported and the blocks run: the library falls back to numpy);
# * compiles the numba CPU kernels (tools/warm_kernels.py), then runs the blocks most important
#   first, each under `timeout` (60 + 60 + 60 + 60 + 120 s at most, plus 10 s each to stop one that
#   overruns, and 90 s at most for the preflight: under 8.5 minutes in all, 7 without the preflight):
#   1. the Triton kernels bit for bit against the CPU specification (tests/gpu_kernels_checks.py);
#   2. detection, publishing and updating on CUDA tensors against the CPU, bit for bit
#      (`pytest -m gpu tests/unit/test_device_paths.py`);
#   3. detection, scatter and step apply against HBM bandwidth (tools/bench_gpu_kernels.py);
#   4. the core benchmark with weights, snapshots and replicas on the GPU, 1B parameters;
#   5. VLLMTarget on CUDA parameters, where vLLM is importable (the image has none: skipped);
#   6. a real vLLM engine with CUDA graphs, where vLLM's CUDA build is installed (skipped likewise);
# * writes the JSON results and summary.txt (one line per block: "<block> ok|failed (rc N)|timed
#   out, <seconds> s" or "<block> skipped: why") to OUT_DIR, the logs to OUT_DIR/logs/, and packs
#   the logs into OUT_DIR/logs.tar.gz; under the device tool (OUT_DIR = $OUT, of which at most 8
#   files come back) the packed logs replace the folder. Results of an earlier run in OUT_DIR are
#   removed first (a folder that holds other files is refused: the script marks its own with
#   .gpu_check). Ctrl-C or SIGTERM stops the running block, packs the logs and exits 130 / 143.
# --smoke runs the warm-up and blocks 1-4 on the CPU (Triton's interpreter, tiny sizes, block 2's
# tests on CPU tensors): tests/unit/test_gpu_check.py checks this script that way.
# The device call (the session's 15 minutes count the machine's start, 1-2 minutes, and each call):
#   run(command="bash tools/gpu_check.sh $OUT", carry=[".whl"], timeout_s=510)
# Environment: GPU_CHECK_PYTHON (the interpreter), GPU_CHECK_WHEELS (a folder of wheels to install,
# default the checkout's .whl; "none": install none), GPU_CHECK_SITE (where, default /tmp/site).
set -uo pipefail
usage() { sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
SMOKE=0
OUT_DIR=""
for arg in "$@"; do
    case $arg in
        --smoke) SMOKE=1 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "tools/gpu_check.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
        *) if [ -n "$OUT_DIR" ]; then echo "tools/gpu_check.sh: one OUT_DIR, got $OUT_DIR and $arg" >&2; exit 2; fi
           OUT_DIR=$arg ;;
    esac
done
OUT_DIR=${OUT_DIR:-${OUT:-runs/gpu}}
case $OUT_DIR in /*) ;; *) OUT_DIR="$PWD/$OUT_DIR" ;; esac  # relative to where it was called from
WHEELS=${GPU_CHECK_WHEELS:-}
case $WHEELS in ""|none|/*) ;; *) WHEELS="$PWD/$WHEELS" ;; esac
cd "$(dirname "$0")/.."
LOGS="$OUT_DIR/logs"
SUMMARY="$OUT_DIR/summary.txt"
RESULTS=(gpu_kernels.json core_gpu.json vllm_apply_gpu.json vllm_engine.json)
# Under the device tool OUT_DIR is its $OUT: emptied before each command, at most 8 files back.
UNDER_TOOL=0
if [ -n "${OUT:-}" ] && [ "$(cd "$OUT_DIR" 2>/dev/null && pwd)" = "$(cd "$OUT" 2>/dev/null && pwd)" ]; then
    UNDER_TOOL=1
fi
MARK="$OUT_DIR/.gpu_check"  # this script wrote the folder: its earlier results may be removed
if [ -d "$OUT_DIR" ] && [ ! -e "$MARK" ] && [ -n "$(ls -A "$OUT_DIR" 2>/dev/null)" ] && [ $UNDER_TOOL = 0 ]; then
    echo "tools/gpu_check.sh: OUT_DIR $OUT_DIR holds files this script did not write; give a new or empty folder" >&2
    exit 2
fi
if ! mkdir -p "$OUT_DIR" 2>/dev/null || ! [ -w "$OUT_DIR" ]; then
    echo "tools/gpu_check.sh: cannot write to OUT_DIR $OUT_DIR; give a writable folder" >&2
    exit 2
fi
rm -rf "$LOGS" "$OUT_DIR/logs.tar.gz" "${RESULTS[@]/#/$OUT_DIR/}"  # an earlier run's results
mkdir -p "$LOGS"
: > "$MARK"
: > "$SUMMARY"

pack_logs() {
    tar -czf "$OUT_DIR/logs.tar.gz" -C "$OUT_DIR" logs
    if [ $UNDER_TOOL = 1 ]; then rm -rf "$LOGS"; fi
}

# Ctrl-C or SIGTERM: `timeout` runs each block in a process group of its own, which the terminal's
# signal does not reach, so the running block is stopped here, then the logs are packed.
current=""
current_name="the preflight"
on_signal() {
    if [ -n "$current" ]; then
        kill -TERM "$current" 2>/dev/null
        wait "$current" 2>/dev/null
    fi
    echo "interrupted by SIG$1 in $current_name" | tee -a "$SUMMARY"
    pack_logs
    exit "$2"
}
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM

if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    PY=$GPU_CHECK_PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python3
fi
if [ -n "$WHEELS" ] && [ "$WHEELS" != none ] && ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    echo "GPU_CHECK_WHEELS $WHEELS holds no wheels: none installed" | tee -a "$SUMMARY"
fi
WHEELS=${WHEELS:-$PWD/.whl}
if [ "$WHEELS" != none ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    SITE=${GPU_CHECK_SITE:-/tmp/site}
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "$WHEELS"/*.whl > "$LOGS/wheels.log" 2>&1 \
        || echo "installing $WHEELS/*.whl failed (a wheel for another Python, or no pip?), see $LOGS/wheels.log" \
            | tee -a "$SUMMARY"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ "$SMOKE" = 1 ]; then
    DEVICE=cpu
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
else
    DEVICE=cuda
    nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1 || true
fi

# Preflight: what the blocks need, and the versions that ran (environment.txt).
timeout --kill-after=10 90 "$PY" - "$DEVICE" > "$LOGS/environment.txt" 2>&1 <<'PY' &
import platform, sys
device = sys.argv[1]
print("python", platform.python_version(), sys.executable)
missing = []
for name in ("torch", "triton", "numpy", "safetensors", "zstandard", "transformers", "numba"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as e:  # an import that fails for any reason is missing here
        if name == "numba":  # optional: torch_deltasync then runs its numpy/torch paths (same bytes)
            print(f"numba does not import ({type(e).__name__}: {e}): the compiled CPU kernels are off, "
                  "the CPU parts of the blocks run slower")
        else:
            missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    version = ".".join(platform.python_version_tuple()[:2])
    hints = [f"{sys.executable} cannot run the checks (GPU_CHECK_PYTHON chooses another interpreter)."]
    if any(not m.startswith("zstandard") for m in missing):
        hints.append("The lent machines' python3 has every module but zstandard.")
    if any(m.startswith("zstandard") for m in missing):
        hints.append(f"zstandard: `bash tools/gpu_wheels.sh {version}` here (wheels for Python {version}), "
                     "then carry \".whl\".")
    sys.exit(f"missing: {'; '.join(missing)}. " + " ".join(hints))
import torch
import torch_deltasync
from torch_deltasync import _native
print("torch_deltasync", torch_deltasync.__file__, "compiled kernels", _native.enabled())
if device == "cuda":
    if not torch.cuda.is_available():
        sys.exit("torch.cuda.is_available() is False: no GPU is seen by this torch")
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.0f} GiB", "capability", f"{p.major}.{p.minor}")
PY
current=$!
wait "$current"
rc=$?
current=""
cat "$LOGS/environment.txt"
if [ $rc != 0 ]; then
    echo "preflight failed (rc $rc): see $LOGS/environment.txt" | tee -a "$SUMMARY"
    pack_logs
    exit 1
fi

# block NAME LIMIT_S COMMAND...: runs COMMAND under `timeout`, its output in LOGS/NAME.log.
failed=0
block() {
    local name=$1 limit=$2 rc start=$SECONDS
    shift 2
    echo "== $name (at most $limit s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1 &
    current=$! current_name="block $name"
    wait "$current"
    rc=$?
    current=""
    tail -n 25 "$LOGS/$name.log"
    local took=$((SECONDS - start)) state="ok"
    if [ $rc = 124 ]; then state="timed out"; failed=1
    elif [ $rc = 137 ]; then state="killed by SIGKILL (out of memory, or still running 10 s past its limit)"; failed=1
    elif [ $rc != 0 ]; then state="failed (rc $rc)"; failed=1
    fi
    echo "$name $state, $took s" | tee -a "$SUMMARY"
}
skip() { echo "$1 skipped: $2" | tee -a "$SUMMARY"; }

# numba compiles the CPU kernels once per machine (~20 s on 2 cores; cached next to the sources):
# here, so that no block below pays it inside its limit or its timings.
block warm_kernels 60 "$PY" tools/warm_kernels.py
if [ "$SMOKE" = 1 ]; then
    block kernels_checks 300 "$PY" tests/gpu_kernels_checks.py cpu
    block device_tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_device_paths.py
    block kernels_bench 120 "$PY" tools/bench_gpu_kernels.py --device cpu --numel 20000 --repeat 1 \
        --out "$OUT_DIR/gpu_kernels.json"
    block core 300 "$PY" tools/bench_core.py --device cpu --synthetic --sizes tiny --steps 1 \
        --out "$OUT_DIR/core_gpu.json"
else
    block kernels_checks 60 "$PY" tests/gpu_kernels_checks.py cuda
    block device_tests 60 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_device_paths.py
    block kernels_bench 60 "$PY" tools/bench_gpu_kernels.py --numel 500000000 --out "$OUT_DIR/gpu_kernels.json"
    block core 120 "$PY" tools/bench_core.py --device cuda --synthetic --sizes 1b --steps 2 \
        --out "$OUT_DIR/core_gpu.json"
    # VLLMTarget on CUDA parameters of one TP rank against vLLM's load_weights (the CPU oracle's TP
    # stub, models moved to the GPU): needs vLLM importable, which tools/setup.sh's .venv has.
    if "$PY" -c "import vllm" > /dev/null 2>&1; then
        block vllm_apply 150 env VLLM_TARGET_DEVICE=cpu "$PY" tools/bench_vllm_apply.py --device cuda \
            --sizes 100m 1b --nnz 1e4 1e6 1e7 --tp 2 --rank 1 --out "$OUT_DIR/vllm_apply_gpu.json"
    else
        skip vllm_apply "vllm is not importable by $PY"
    fi
    # A real LLM (CUDA graphs on) running the deltasync weight-transfer backend: needs vLLM's CUDA
    # build (`pip install vllm==0.33.0`), which no lent image has so far.
    if "$PY" -c "import vllm, importlib.util as u; assert u.find_spec('vllm._C') or u.find_spec('vllm._C_stable_libtorch')" \
        > /dev/null 2>&1; then
        block vllm_engine 240 "$PY" tools/gpu_vllm_check.py --out "$OUT_DIR/vllm_engine.json" --workdir /tmp/gpu_check_vllm_engine
    else
        skip vllm_engine "vLLM's CUDA kernels are not installed for $PY"
    fi
fi
echo "== summary ($SUMMARY)"
cat "$SUMMARY"
pack_logs
exit $failed
