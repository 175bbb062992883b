"""Handing freed memory back to the system during long inputs.

A long input's layers each allocate and free tens of megabytes (the layer's activations, the norm engine's copies,
a rollout's row blocks). glibc keeps freed blocks of that size in its heaps, spread over the arenas of torch's and
numba's threads, so the resident memory of a streamed 4,096-token pass grew by about 50 MB per layer although the
live tensors grew by 4 MB (measured on SmolLM2-135M; docs/performance.md). `release()` asks glibc to return its free
pages (`malloc_trim(0)`) once per layer of an input of at least `LONG_TOKENS` tokens; elsewhere (another C library,
another system) it does nothing. It changes no setting: only memory already freed is returned.

`check_fits` says before a pass starts when its attention matrices cannot fit the memory available (estimated from
the batch, n, the layers and heads: `attention_bytes`), and before methods run when their own results cannot
(`result_bytes`: a [layer, n, n] map per input, [layer, head, n, n] with heads, [layer, K, n] for K target rows),
in one line instead of an allocation error or the kernel's out-of-memory kill.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from mixlens.errors import MixlensError

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


ATTENTION_COPIES = 3  # an eager layer's transient [B, H, n, n] beyond the kept α: scores, softmax, its float32 copy


def available_bytes(device: object = "cpu") -> int | None:
    """Memory a request may still take: the system's MemAvailable (Linux), or a CUDA device's free memory; None
    when unknown (no check)."""
    if str(device).startswith("cuda"):
        import torch  # start-up speed: this module is imported by the command modules

        return int(torch.cuda.mem_get_info(str(device))[0]) if torch.cuda.is_available() else None
    try:
        with Path("/proc/meminfo").open(encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def attention_bytes(batch: int, n: int, layers: int, heads: int, kept_layers: int) -> int:
    """Bytes of a traced pass's attention matrices: `kept_layers` layers' float32 α [B, H, n, n] held, plus the
    transients of the layer running (`ATTENTION_COPIES`)."""
    return 4 * batch * heads * n * n * (kept_layers + ATTENTION_COPIES)


def result_bytes(
    dims: Sequence[Sequence[str]], *, batch: int, n: int, layers: int, heads: int, rows: int | None = None
) -> int:
    """Bytes of the methods' own float32 results, one tuple of axis names per method (`Method.dims_for`): layer L,
    head H, target K (`rows`, or n for every row), source n, class 1 (a class axis is small); plus, for a method
    with a target axis, one layer's [B, H, K, n] attention rows it reads while computing them (α rebuilt from q and
    K in row mode, or the layer's copy)."""
    size = {"layer": layers, "head": heads, "target": rows or n, "source": n, "class": 1}
    need = 0
    for axes in dims:
        need += 4 * batch * math.prod(size.get(a, 1) for a in axes)
        if "target" in axes:
            need += 4 * batch * heads * (rows or n) * n
    return need


BACKWARD_FLOATS = 24  # floats per token and hidden dim a layer's backward holds (its activations, about 24·d)


def backward_bytes(batch: int, n: int, layers: int, d: int) -> int:
    """Bytes a gradient pass through `layers` layers of width `d` holds for `batch` × `n` tokens (float32): every
    gradient pass recomputes each layer in its backward (`trace.recomputed_layers`), so it keeps every layer's
    input, `layers` · d per token, plus one layer's activations at a time, about `BACKWARD_FLOATS` · d per token
    (measured on SmolLM2 at 2,015 tokens: 0.29 GB; keeping every layer's activations took 3.3 GB)."""
    return 4 * batch * n * d * (layers + BACKWARD_FLOATS)


def check_fits(need: int, what: str, hint: str, device: object = "cpu") -> None:
    """MixlensError, before the work starts, when `need` bytes exceed what the machine has available."""
    have = available_bytes(device)
    if have is not None and need > have:
        raise MixlensError(f"{what} needs about {need / 1e9:.1f} GB but {have / 1e9:.1f} GB are available; {hint}")


def out_of_memory(e: BaseException) -> str | None:
    """One line for an allocation failure that got past `check_fits` (a method's own n × n results, another
    process taking the memory meanwhile), or None when `e` is not one."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in text:
        detail = text.split(":", 1)[-1].strip() if "allocate" in text else type(e).__name__
        return (
            f"out of memory ({detail}); use fewer or shorter inputs, fewer methods, or the row mode "
            "(--rows last) on a long decoder input"
        )
    return None
