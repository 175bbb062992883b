"""Handing freed memory back to the system during long inputs.

A long input's layers each allocate and free tens of megabytes (the layer's activations, the norm engine's copies,
a rollout's row blocks). glibc keeps freed blocks of that size in its heaps, spread over the arenas of torch's and
numba's threads, so the resident memory of a streamed 4,096-token pass grew by about 50 MB per layer although the
live tensors grew by 4 MB (measured on SmolLM2-135M; docs/performance.md). `release()` asks glibc to return its free
pages (`malloc_trim(0)`) once per layer of an input of at least `LONG_TOKENS` tokens; elsewhere (another C library,
another system) it does nothing. It changes no setting: only memory already freed is returned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

LONG_TOKENS = 1024  # inputs from this length on release freed memory after each layer


@functools.cache
def _trim() -> object | None:
    """glibc's `malloc_trim`, or None (looked up on first use)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release(n_tokens: int) -> None:
    """Return freed heap pages to the system when `n_tokens` makes an input long (see the module docstring)."""
    if n_tokens >= LONG_TOKENS:
        fn = _trim()
        if fn is not None:
            fn(0)  # type: ignore[operator]
