"""Module paths that moved behind a package face in 0.2: ``torch_deltasync.store.local`` and the
like are private modules now (``store/_local.py``), and the package (``torch_deltasync.store``)
is the public path. An old ``from torch_deltasync.store.local import LocalStore`` still works, with
a ``DeprecationWarning`` that names the package to import from (as the root does for names that
left it)."""

from __future__ import annotations

import importlib
import sys
import types
import warnings


class _MovedModule(types.ModuleType):
    """Stands in ``sys.modules`` for a module path that moved; every attribute read warns and is
    answered by the private module that holds the code now."""

    def __init__(self, old: str, private: str, public: str) -> None:
        super().__init__(old, f"Moved: import from {public}.")
        self.__dict__.update(_private=private, _public=public)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        warnings.warn(f"{self.__name__} is private since 0.2 ({self._private}); import {name} from "
                      f"{self._public}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(self._private), name)


def alias_moved(package: str, names: tuple[str, ...]) -> None:
    """Register ``<package>.<name>`` as a deprecated alias of ``<package>._<name>`` for each name."""
    for name in names:
        sys.modules.setdefault(f"{package}.{name}", _MovedModule(f"{package}.{name}", f"{package}._{name}", package))
