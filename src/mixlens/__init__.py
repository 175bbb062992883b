"""mixlens: exact, fast context-mixing analysis of Transformers."""

__version__ = "0.1.0"

from mixlens import methods  # noqa: E402  (fills the registry)
from mixlens.errors import MixlensError, ReconstructionError  # noqa: E402
from mixlens.lens import Lens, load  # noqa: E402
from mixlens.pipeline import run_methods  # noqa: E402
from mixlens.result import Analysis, Attribution  # noqa: E402

__all__ = ["Analysis", "Attribution", "Lens", "MixlensError", "ReconstructionError", "load", "methods",
           "run_methods", "__version__"]
