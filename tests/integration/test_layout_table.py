"""The README's layout table is checked against the tree: every path it names exists, and every
public module and package of the library (and every integration) has a row."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _table_paths() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    paths = []
    for row in rows:
        first_cell = row.split("|")[1]
        paths += re.findall(r"`([^`]+)`", first_cell)
    return paths


def _expand(paths: list[str]) -> set[str]:
    """Table cells may continue a path with a bare file name (``torch_deltasync/x.py``, ``y.py``)."""
    out, folder = set(), ""
    for p in paths:
        if "/" in p:
            folder = p.rsplit("/", 1)[0] + "/" if not p.endswith("/") else p
            out.add(p)
        else:
            out.add(folder + p)
    return out


def test_every_path_in_the_layout_table_exists():
    paths = _expand(_table_paths())
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README layout table names paths that do not exist: {missing}"


def test_every_public_module_and_integration_has_a_row():
    paths = _expand(_table_paths())
    pkg = ROOT / "torch_deltasync"
    wanted = [f"torch_deltasync/{p.name}" for p in pkg.glob("*.py") if not p.name.startswith("_")]
    wanted += [f"torch_deltasync/{p.name}/" for p in pkg.iterdir()
               if p.is_dir() and (p / "__init__.py").exists() and p.name != "integrations"]  # its children have rows
    integ = pkg / "integrations"
    wanted += [f"torch_deltasync/integrations/{p.name}" + ("/" if p.is_dir() else "")
               for p in integ.iterdir()
               if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").exists())]
    absent = sorted(w for w in wanted if w not in paths)
    assert not absent, f"README layout table has no row for: {absent}"
