"""The engine's one door: what the rest of mixlens uses of the norm-decomposition engine and its compiled passes.

The engine computes, for every layer, the per-pair vectors of Kobayashi et al.'s decomposition and their norms
without materialising [head, target, source, hidden] (`norms`), in compiled numba kernels on the CPU (`_compiled`,
`_kernels`, `_numba`) or in plain torch passes on any device (`_torch_passes`), and checks on every run that they
rebuild the model's real outputs (`tolerance`). Modules outside the engine import from here only.

Setting: `set_backend("compiled" | "torch")` (or `with backend(...)`) chooses the CPU path; "compiled" is the
default, other devices always take the torch passes. Both give the same numbers to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mixlens.errors import MixlensError
from mixlens.methods import norms
from mixlens.methods._compiled import parallel
from mixlens.methods._numba import njit
from mixlens.methods.norms import (
    ATTN_TOLERANCES,
    BLOCK_NORMS,
    NORM_RUN,
    RATIO_VARIANTS,
    ROW_FLOOR,
    TOLERANCE,
    TOLERANCES,
    BlockNorms,
    NormRun,
    PairRows,
    attn_row_size,
    attn_sum,
    attn_tolerance,
    block_norms,
    head_vectors,
    pair_rows,
    quad_norm,
    quad_norms,
    row_error,
    run_dtype,
    stream_layer,
    tolerance,
)

__all__ = [
    "ATTN_TOLERANCES",
    "BLOCK_NORMS",
    "NORM_RUN",
    "BACKENDS",
    "RATIO_VARIANTS",
    "ROW_FLOOR",
    "TOLERANCE",
    "TOLERANCES",
    "BlockNorms",
    "NormRun",
    "PairRows",
    "attn_row_size",
    "attn_sum",
    "attn_tolerance",
    "backend",
    "block_norms",
    "get_backend",
    "head_vectors",
    "njit",
    "pair_rows",
    "parallel",
    "quad_norm",
    "quad_norms",
    "row_error",
    "run_dtype",
    "set_backend",
    "stream_layer",
    "tolerance",
]

BACKENDS = ("compiled", "torch")


def get_backend() -> str:
    """The CPU path the engine takes now: 'compiled' (numba kernels) or 'torch'."""
    return "compiled" if norms.COMPILED else "torch"


def set_backend(name: str) -> None:
    """Choose the engine's CPU path for the process: 'compiled' (numba kernels, the default) or 'torch'."""
    if name not in BACKENDS:
        raise MixlensError(f"unknown engine backend '{name}'; valid: {', '.join(BACKENDS)}")
    norms.COMPILED = name == "compiled"


@contextmanager
def backend(name: str) -> Iterator[None]:
    """`set_backend(name)` for the block, then the previous path again."""
    before = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(before)
