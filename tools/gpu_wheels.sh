#!/usr/bin/env bash
# Wheels of the packages that a lent GPU machine's image lacks, for tools/gpu_check.sh there:
#   bash tools/gpu_wheels.sh [PYTHON_VERSION]      # default 3.12, the image's python3
# The image (/work/.library/device/KINDS.md) holds PyTorch, Triton, numba, numpy, safetensors, tqdm
# and transformers, and reaches no package index. Of what `import torch_deltasync` needs it lacks
# zstandard alone. This script downloads it (the version tools/constraints.txt pins) into .whl/,
# which git ignores. Name it in the device run's `carry` (`carry: [".whl"]`); gpu_check.sh installs
# what it finds there into /tmp/site, without an index.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
PIP=(python3 -m pip)
[ -x .venv/bin/python ] && PIP=(.venv/bin/python -m pip)
pkgs=()
for name in zstandard; do
    pin=$(grep -i "^$name==" tools/constraints.txt) || { echo "tools/gpu_wheels.sh: no pin for $name in tools/constraints.txt" >&2; exit 1; }
    pkgs+=("$pin")
done
rm -rf .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"${PIP[@]}" download --disable-pip-version-check -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${platforms[@]}" -d .whl "${pkgs[@]}"
ls -l .whl
