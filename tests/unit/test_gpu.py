"""The Triton kernels of torch_deltasync/_gpu.py against the CPU specification.

On the CPU they run under Triton's interpreter, which must be switched on before triton is
imported, so the checks (tests/gpu_kernels_checks.py) run in a child process. With a GPU,
``pytest -m gpu`` runs the same checks compiled on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHECKS = Path(__file__).resolve().parents[1] / "gpu_kernels_checks.py"
ROOT = Path(__file__).resolve().parents[2]


def _run(device: str, interpret: bool) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, str(CHECKS), device], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_kernels_under_the_triton_interpreter():
    pytest.importorskip("triton")  # noqa: needs triton (installed with torch's CUDA wheels)
    out = _run("cpu", interpret=True)
    assert "all checks passed" in out and out.count(": ok") == 9, out


@pytest.mark.gpu
def test_kernels_on_cuda():
    assert torch.cuda.is_available(), "run with -m gpu on a machine with a CUDA device"
    out = _run("cuda", interpret=False)
    assert "all checks passed" in out, out
