"""Attribution methods; importing this package fills the registry: every public module of the package is imported
(registration side effects), so a method in a new module is found without naming it here."""

import importlib
import pkgutil

from mixlens.methods.registry import REGISTRY, Method, MethodOutput, Option, check_options, get, names, register

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["REGISTRY", "Method", "MethodOutput", "Option", "check_options", "get", "names", "register"]
