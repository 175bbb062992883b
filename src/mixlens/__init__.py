"""mixlens: exact, fast context-mixing analysis of Transformers.

The public names load on first use (PEP 562), so `import mixlens` — and the command line, which imports
`mixlens.cli` — stays cheap until a model is needed.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name → the module that defines it
_EXPORTS = {
    "Analysis": "mixlens.result",
    "Attribution": "mixlens.result",
    "Explanation": "mixlens.result",
    "Lens": "mixlens.lens",
    "load": "mixlens.lens",
    "MixlensError": "mixlens.errors",
    "ReconstructionError": "mixlens.errors",
    "run_methods": "mixlens.pipeline",
}

if TYPE_CHECKING:
    from mixlens import methods
    from mixlens.errors import MixlensError, ReconstructionError
    from mixlens.lens import Lens, load
    from mixlens.pipeline import run_methods
    from mixlens.result import Analysis, Attribution, Explanation

__all__ = [
    "Analysis",
    "Attribution",
    "Explanation",
    "Lens",
    "MixlensError",
    "ReconstructionError",
    "load",
    "methods",
    "run_methods",
    "__version__",
]


def submodule_getattr(package: str) -> Callable[[str], ModuleType]:
    """A module `__getattr__` for PACKAGE that imports its submodules on first attribute access, so documented
    paths such as `mixlens.stats.mixing.expansion_rate` work after a bare `import mixlens`."""

    def getattr_(name: str) -> ModuleType:
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")  # the import binds it on the package too
        raise AttributeError(f"module '{package}' has no attribute '{name}'")

    return getattr_


_submodule = submodule_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    return _submodule(name)  # subpackages and modules; `methods` also fills the method registry


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
