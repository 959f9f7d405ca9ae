"""tools/gpu_check.sh, the one script a lent GPU machine runs, checked here on the CPU.

``--smoke`` runs its blocks at toy sizes (the Triton kernels under the interpreter), through the same
preflight, timeouts, summary and packed logs as on the GPU; a broken import stops it at the
preflight with the module's name."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _run(out: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), "--smoke", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_smoke_runs_every_block_and_reports_bit_exact_results(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "gpu"
    r = _run(out)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary] == [["kernels_checks", "ok,"], ["device_tests", "ok,"], ["kernels_bench", "ok,"], ["core", "ok,"]]
    checks = (out / "logs" / "kernels_checks.log").read_text()
    assert "all checks passed" in checks and checks.count(": ok") == 9, checks
    assert "\n9 passed" in (out / "logs" / "device_tests.log").read_text()
    kernels = json.loads((out / "gpu_kernels.json").read_text())
    assert kernels["device"] == "cpu (Triton interpreter)"
    # the benchmark asserts bit-exact detection before it times; densities are those asked for
    assert [round(row["density"], 2) for row in kernels["rows"]] == [0.01, 0.05]
    assert all(row["numel"] == 20_000 and row["detect_s"] > 0 for row in kernels["rows"])
    core = json.loads((out / "core_gpu.json").read_text())
    assert [s["size"] for s in core["sizes"]] == ["tiny"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"logs/environment.txt", "logs/kernels_checks.log", "logs/kernels_bench.log", "logs/core.log"} <= names


def test_a_module_that_does_not_import_stops_at_the_preflight(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "triton.py").write_text("raise ImportError('triton built for another CUDA')\n")
    out = tmp_path / "gpu"
    r = _run(out, {"PYTHONPATH": str(shadow)}, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "missing: triton (ImportError: triton built for another CUDA)" in r.stdout
    assert "tools/gpu_wheels.sh" in r.stdout
    assert (out / "summary.txt").read_text().startswith("preflight failed (rc 1)")
    assert not (out / "gpu_kernels.json").exists()
