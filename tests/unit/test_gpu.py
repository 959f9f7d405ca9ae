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


@pytest.mark.parametrize("call,message", [
    (lambda g: g.detect(torch.randn(64, 2)[:, 0], torch.zeros(64, dtype=torch.int16), torch.bfloat16),
     "1-D and contiguous"),
    (lambda g: g.detect(torch.randn(100), torch.zeros(50, dtype=torch.int16), torch.bfloat16), "as many elements"),
    (lambda g: g.detect(torch.randn(100), torch.zeros(100, dtype=torch.int32), torch.bfloat16), "width"),
    (lambda g: g.detect(torch.randn(8), torch.zeros(8, dtype=torch.int16), torch.bfloat16, method="REREAD"),
     "method must be one of"),
    (lambda g: g.scatter(torch.zeros(10), torch.arange(3, dtype=torch.int32), torch.ones(3)), "int64 positions"),
    (lambda g: g.apply_steps(torch.zeros(10), torch.arange(3), torch.ones(2, dtype=torch.int32)), "one entry"),
])
def test_kernels_refuse_what_they_would_misread(call, message):
    """Checked before any kernel runs: a strided tensor read as flat, a short snapshot read past its
    end, or steps for other positions would give wrong values silently (or read outside a buffer)."""
    pytest.importorskip("triton")
    from torch_deltasync import _gpu

    with pytest.raises(ValueError, match=message):
        call(_gpu)


def test_tensors_past_int32_offsets_are_left_to_torch():
    pytest.importorskip("triton")
    from torch_deltasync import _gpu

    big = torch.empty(_gpu.MAX_NUMEL, device="meta")
    assert _gpu.detect(big, torch.empty(_gpu.MAX_NUMEL, dtype=torch.int16, device="meta"), torch.bfloat16) is None
