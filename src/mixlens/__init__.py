"""mixlens: exact, fast context-mixing analysis of Transformers.

The public names load on first use (PEP 562), so `import mixlens` — and the command line, which imports
`mixlens.cli` — stays cheap until a model is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mixlens.lazy import submodule_getattr
from mixlens.version import __version__

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


_submodule = submodule_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    return _submodule(name)  # subpackages and modules; `methods` also fills the method registry


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
