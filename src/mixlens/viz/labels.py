"""Names of things in figure titles (no heavy imports: the commands use it at module level)."""

from __future__ import annotations

from pathlib import Path


def model_label(model: str) -> str:
    """A model for a figure title: a local path or hub id by its last part (the folder, not the whole path)."""
    return Path(str(model).rstrip("/")).name or str(model)
