"""Attribution methods; importing this package fills the registry."""

from mixlens.methods import attention, norms  # noqa: F401  (registration side effects)
from mixlens.methods.registry import REGISTRY, Method, get, names, register

__all__ = ["REGISTRY", "Method", "get", "names", "register"]
