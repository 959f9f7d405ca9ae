"""tools/gpu_check.sh, the one script a lent GPU machine runs, checked here on the CPU.

``--smoke`` runs its blocks at toy sizes (the Triton kernels under the interpreter), through the same
preflight, timeouts, summary and packed logs as on the GPU; a module that does not import stops it at
the preflight with the module's name, a numba that does not import does not; a SIGTERM stops the
running block and packs the logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _env(tmp_path: Path, shadow: dict[str, str] | None = None) -> dict:
    """This interpreter, no carried wheels; ``shadow``: modules (name -> source) that take the place
    of installed ones."""
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_WHEELS": "none",
           "GPU_CHECK_SITE": str(tmp_path / "site")}
    env.pop("OUT", None)
    if shadow:
        folder = tmp_path / "shadow"
        folder.mkdir()
        for name, source in shadow.items():
            (folder / f"{name}.py").write_text(source)
        env["PYTHONPATH"] = str(folder)
    return env


def _run(out: str, env: dict, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--smoke", out], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_smoke_runs_every_block_and_reports_bit_exact_results(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "gpu"
    (out / "logs").mkdir(parents=True)
    (out / ".gpu_check").write_text("")  # an earlier run's folder: its results are replaced
    (out / "logs" / "old.log").write_text("an earlier run")
    (out / "gpu_kernels.json").write_text("{}")
    r = _run("gpu", _env(tmp_path), cwd=tmp_path)  # OUT_DIR relative to where it is called from
    assert r.returncode == 0, r.stdout + r.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary] == [["warm_kernels", "ok,"], ["kernels_checks", "ok,"], ["device_tests", "ok,"],
                                                      ["kernels_bench", "ok,"], ["core", "ok,"]]
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
    assert "logs/old.log" not in names


@pytest.mark.parametrize("module,hint", [("triton", False), ("zstandard", True)])
def test_a_module_that_does_not_import_stops_at_the_preflight(tmp_path, module, hint):
    env = _env(tmp_path, {module: f"raise ImportError('{module} built for another CUDA')\n"})
    r = _run(str(tmp_path / "gpu"), env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"missing: {module} (ImportError: {module} built for another CUDA)" in r.stdout
    assert ("tools/gpu_wheels.sh" in r.stdout) == hint
    assert (tmp_path / "gpu" / "summary.txt").read_text().startswith("preflight failed (rc 1)")
    assert not (tmp_path / "gpu" / "gpu_kernels.json").exists()


def test_a_folder_it_did_not_write_is_refused_untouched(tmp_path):
    out = tmp_path / "project"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "train.log").write_text("precious")
    (out / "summary.txt").write_text("notes")
    r = _run(str(out), _env(tmp_path), timeout=60)
    assert r.returncode == 2 and "holds files this script did not write" in r.stderr, r.stdout + r.stderr
    assert (out / "logs" / "train.log").read_text() == "precious" and (out / "summary.txt").read_text() == "notes"


def _descendants(pid: int) -> set[int]:
    """Processes below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def test_sigterm_stops_the_running_block_and_a_broken_numba_passes_the_preflight(tmp_path):
    """numba that does not import: reported, the blocks run (the library falls back to numpy).
    A SIGTERM while a block runs: the block's processes end, the logs are packed, exit 143."""
    pytest.importorskip("triton")
    env = _env(tmp_path, {"numba": "raise ImportError('Numba needs NumPy 2.4 or less. Got NumPy 2.9.')\n"})
    out = tmp_path / "gpu"
    p = subprocess.Popen(["bash", str(SCRIPT), "--smoke", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (out / "logs" / "kernels_checks.log").exists() or not _descendants(p.pid):
        assert p.poll() is None and time.monotonic() < deadline, "the first block did not start"
        time.sleep(0.2)
    time.sleep(1)
    block = _descendants(p.pid)
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=60)
    assert p.returncode == 143, stdout
    env_txt = ""
    with tarfile.open(out / "logs.tar.gz") as tar:
        env_txt = tar.extractfile("logs/environment.txt").read().decode()
    assert "numba does not import (ImportError: Numba needs NumPy 2.4 or less" in env_txt
    assert "compiled kernels False" in env_txt
    assert (out / "summary.txt").read_text().splitlines()[-1].startswith("interrupted by SIGTERM in block ")
    time.sleep(1)
    assert block and not any(Path(f"/proc/{pid}").exists() for pid in block), "the block's processes were left running"
