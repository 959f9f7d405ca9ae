"""The README's quick start runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch


def test_quick_start_runs(tmp_path, monkeypatch):
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"## Quick start\s+```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    policy, replica = scope["policy"], scope["replica"]
    for a, b in zip(policy.state_dict().values(), replica.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).view(torch.int16), b.view(torch.int16))
    assert scope["v"] == 0
