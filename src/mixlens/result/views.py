"""How the result types are drawn: they draw nothing themselves. The views in `mixlens.viz` register here
(`mixlens.viz.views`, the one module named below, loaded the first time a result is shown), so no result module
imports a view: `Attribution.show()`, `Explanation.html()` and the notebook representations are thin hooks."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

PROVIDER = "mixlens.viz.views"  # registers every view below when imported
VIEWS = (
    "attribution.show",  # (attribution, inputs, layer=, head=, max_tokens=, console=) → None: terminal view
    "attribution.notebook",  # (attribution) → HTML fragment
    "analysis.notebook",  # (analysis) → HTML fragment
    "explanation.show",  # (explanation, console) → None
    "explanation.page",  # (explanation) → a whole HTML page
    "explanation.notebook",  # (explanation) → HTML fragment
)
_REGISTERED: dict[str, Callable[..., Any]] = {}


def register(name: str, fn: Callable[..., Any]) -> None:
    """Make `fn` the view `name` (one of `VIEWS`)."""
    if name not in VIEWS:
        raise ValueError(f"unknown view {name!r}; views: {', '.join(VIEWS)}")
    _REGISTERED[name] = fn


def view(name: str) -> Callable[..., Any]:
    """The registered view `name`, loading the views on first use."""
    if name not in _REGISTERED:
        importlib.import_module(PROVIDER)
    return _REGISTERED[name]
