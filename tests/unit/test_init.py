"""The public face: a small root ``__all__``, public ``__module__`` paths, no import cycles."""

from __future__ import annotations

import ast
import importlib
import inspect
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


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _public_modules() -> list[str]:
    """Every public module of the library (no ``_``-prefixed part), found by walking the tree."""
    names = []
    for path in sorted(PKG.rglob("*.py")):
        name = _module_name(path)
        if not any(part.startswith("_") for part in name.split(".")):
            names.append(name)
    return names


def _public_callables(mod) -> dict[str, object]:
    """The classes and functions in ``mod.__all__`` (constants and typing aliases have no path).
    A name loaded lazily from a host that is not installed is left out (its own test covers it)."""
    out = {}
    for n in mod.__all__:
        try:
            obj = getattr(mod, n)
        except ImportError:
            continue
        if isinstance(obj, type) or inspect.isfunction(obj):
            out[n] = obj
    return out


def _where(obj) -> str:
    """The path reprs, docs and pickles show for ``obj``."""
    return f"{obj.__module__}.{obj.__qualname__}"


@pytest.mark.parametrize("face", ["torch_deltasync"] + FACES)
def test_package_faces_name_their_own_path(face):
    """A face's re-exports name the face (or, for the root's, the root): never a private module."""
    mod = importlib.import_module(face)
    wrong = {n: _where(o) for n, o in _public_callables(mod).items() if o.__module__ not in (face, "torch_deltasync")}
    assert wrong == {}, f"{face} re-exports these under another module path"


@pytest.mark.parametrize("name", _public_modules())
def test_public_names_resolve_at_a_public_path(name):
    """Every class and function a public module lists names a public module that really has it
    under that name, so ``pickle`` and ``from <__module__> import <name>`` work."""
    mod = importlib.import_module(name)
    bad = {}
    for n, obj in _public_callables(mod).items() if hasattr(mod, "__all__") else ():
        where = obj.__module__
        if any(part.startswith("_") for part in where.split(".")):
            bad[n] = f"{_where(obj)} (private)"
        elif getattr(importlib.import_module(where), obj.__qualname__, None) is not obj:
            bad[n] = f"{_where(obj)} (not found there)"
    assert bad == {}, f"{name} lists names whose __module__ is wrong"


def test_vllm_backend_names_name_the_face():
    """The backend's names are loaded from vLLM on first use; they name the face too."""
    pytest.importorskip("vllm")
    from torch_deltasync.integrations import vllm as face

    got = {n: getattr(face, n).__module__ for n in face._BACKEND_NAMES if not isinstance(getattr(face, n), str)}
    assert "register" in got and "DeltaSyncWeightTransferEngine" in got
    assert got == dict.fromkeys(got, face.__name__)


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


@pytest.mark.parametrize("old,name,public", [
    ("torch_deltasync.store.local", "LocalStore", "torch_deltasync.store"),
    ("torch_deltasync.store.base", "Store", "torch_deltasync.store"),
    ("torch_deltasync.store.retry", "RetryPolicy", "torch_deltasync.store"),
    ("torch_deltasync.targets.module", "ModuleTarget", "torch_deltasync.targets"),
    ("torch_deltasync.targets.vllm", "VLLMTarget", "torch_deltasync.targets"),
    ("torch_deltasync.targets.vllm_engine", "VLLMEngineTarget", "torch_deltasync.targets"),
])
def test_module_paths_of_0_1_still_import_with_a_warning(old, name, public):
    import importlib

    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old} is private since 0.2 .*; import {name} from {public}$"):
        obj = getattr(module, name)
    assert obj is getattr(importlib.import_module(public), name)
    with pytest.raises(AttributeError):  # a name the module never had is still an AttributeError
        with pytest.warns(DeprecationWarning):
            getattr(module, "no_such_name")
