"""The public face: a small root ``__all__``, public ``__module__`` paths, no import cycles."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import torch_deltasync

PKG = Path(torch_deltasync.__file__).resolve().parent
FACES = ["torch_deltasync.codecs", "torch_deltasync.sender", "torch_deltasync.receiver", "torch_deltasync.store",
         "torch_deltasync.targets", "torch_deltasync.integrations.vllm", "torch_deltasync.integrations.torchrl",
         "torch_deltasync.integrations.rollout"]


def test_root_exports_at_most_20_names_under_the_root_path():
    names = torch_deltasync.__all__
    assert len(names) <= 20 and len(set(names)) == len(names)
    assert [n for n in names if getattr(torch_deltasync, n).__module__ != "torch_deltasync"] == []
    assert "CorruptObjectError" not in names and torch_deltasync.errors.CorruptObjectError  # errors: their module


@pytest.mark.parametrize("face", FACES)
def test_package_faces_name_public_paths(face):
    mod = importlib.import_module(face)
    private = [n for n in mod.__all__ if isinstance(getattr(mod, n), type) and "._" in getattr(mod, n).__module__]
    assert private == [], f"{face} re-exports {private} under a private module path"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    """Library modules ``path`` imports anywhere in its body (module level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("torch_deltasync"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("torch_deltasync"))
    return out


def test_no_import_cycles_between_modules():
    """Package faces import their private modules; no module imports back into a module that
    (directly or not) imports it, lazily or not."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = {d for d in _imports(path, name) if d in modules and d != name}
        # a module importing from its own package face is a cycle; a face importing its modules is not
        graph[name] = {d for d in deps if not name.startswith(d + ".") or True}
    # Edges face -> own submodule are the re-exports; ancestors are imported by Python first anyway,
    # so only count a submodule -> face edge as a dependency when the face is not its ancestor.
    for name in graph:
        graph[name] = {d for d in graph[name] if not name.startswith(d + ".")}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_no_library_module_over_600_lines():
    long = {_module_name(p): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


def test_names_that_left_the_root_say_where_they_live():
    from torch_deltasync.errors import CorruptObjectError
    from torch_deltasync.integrations.peft import AdapterSender

    with pytest.warns(DeprecationWarning, match=r"torch_deltasync.CorruptObjectError moved to torch_deltasync.errors"):
        from torch_deltasync import CorruptObjectError as old
    assert old is CorruptObjectError
    with pytest.warns(DeprecationWarning, match=r"moved to torch_deltasync.integrations.peft.AdapterSender"):
        assert torch_deltasync.AdapterSender is AdapterSender
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        torch_deltasync.Nope  # noqa: B018
