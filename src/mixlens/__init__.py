"""mixlens: exact, fast context-mixing analysis of Transformers.

The public names load on first use (PEP 562), so `import mixlens` — and the command line, which imports
`mixlens.cli` — stays cheap until a model is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name → the module that defines it
_EXPORTS = {
    "Analysis": "mixlens.result",
    "Attribution": "mixlens.result",
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
    from mixlens.result import Analysis, Attribution

__all__ = ["Analysis", "Attribution", "Lens", "MixlensError", "ReconstructionError", "load", "methods", "run_methods",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name == "methods":  # the package; importing it fills the method registry
        return importlib.import_module("mixlens.methods")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mixlens' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
