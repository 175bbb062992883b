"""Checks on input text that need no model (and import no torch): shared by the batching and the corpus readers."""

from __future__ import annotations

import unicodedata


def has_visible(s: str) -> bool:
    """Has a character that is neither whitespace nor a control / zero-width format character."""
    if s.strip() and s.isprintable():
        return True
    return any(not c.isspace() and unicodedata.category(c) not in ("Cc", "Cf") for c in s)
