"""Packages whose submodules import on first attribute access (a leaf module: anything may import it)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType


def submodule_getattr(package: str) -> Callable[[str], ModuleType]:
    """A module `__getattr__` for PACKAGE that imports its submodules on first attribute access, so documented
    paths such as `mixlens.stats.mixing.expansion_rate` work after a bare `import mixlens`."""

    def getattr_(name: str) -> ModuleType:
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")  # the import binds it on the package too
        raise AttributeError(f"module '{package}' has no attribute '{name}'")

    return getattr_
