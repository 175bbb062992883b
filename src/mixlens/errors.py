"""Errors that reach users as one clear line (the CLI maps them to exit code 2)."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Sequence
from types import ModuleType


class MixlensError(ValueError):
    """Bad input or an unsupported request; the message is shown to the user as is."""


class ReconstructionError(RuntimeError):
    """A decomposition did not sum back to the real module output (names the layer)."""


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """ " (did you mean 'x'?)" for the choice closest to a mistyped `word`, or '' when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def optional_import(name: str, extra: str) -> ModuleType:
    """The module `name` of an optional dependency (installed with the `extra` of mixlens); when it is missing, a
    `MixlensError` naming the extra to install (one line, CLI exit code 2)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise MixlensError(f'{name} is not installed; install it with: pip install "mixlens[{extra}]"') from None
