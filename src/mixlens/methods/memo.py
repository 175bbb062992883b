"""The results methods share on one trace (`Memo`), kept with the methods: the trace has an opaque slot for it
(`Trace.memo`) and knows no method. `memo_of(trace)` gives a trace's memo, made on first use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mixlens.trace import Trace

if TYPE_CHECKING:
    from mixlens.methods.decompx import DecompXInput
    from mixlens.methods.gradients import JacobianKey, JacobianNorms
    from mixlens.methods.norms import BlockNorms, LayerState, NormRun

    NormStates = tuple[list[LayerState], NormRun]

RowsFn = Callable[[torch.Tensor], torch.Tensor]  # positions [B, K'] → rows [B, K', n] of one layer's matrix
LayerRowsFactory = Callable[[], RowsFn]  # builds a layer's RowsFn when a rollout reaches it (its work arrays then)


def gathered(mat: torch.Tensor) -> LayerRowsFactory:
    """The factory of the rows of a whole matrix [B, n, n] held in memory."""
    return lambda: lambda rows: mat.gather(1, rows[:, :, None].expand(-1, -1, mat.shape[-1]))


@dataclass
class Memo:
    """Intermediate results that methods share on one trace, computed once (None / empty: not yet).
    Maps are [B, L, n(target), n(source)], padding 0."""

    block_norms: BlockNorms | None = None  # the norm engine's result
    alpha_mean: torch.Tensor | None = None  # head-mean α (a by-product of the norm engine)
    globenc: torch.Tensor | None = None  # N-Enc per layer
    alti: torch.Tensor | None = None  # ALTI per layer, rows normalised
    value_zeroing: torch.Tensor | None = None  # value-zeroing per layer, rows normalised
    decompx: dict[str, list[DecompXInput]] = field(default_factory=dict)  # value_bias → one per input
    jacobian_norms: dict[JacobianKey, JacobianNorms] = field(default_factory=dict)
    gradients: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # the
    # target request (target, foil, position) → (∂g/∂e, e, g(e)) of `saliency.gradient`
    targets: torch.Tensor | None = None  # [B, K] positions of target-row mode (`run_methods(targets=)`); None: all
    norm_states: NormStates | None = None  # target-row mode: the engine's per-layer state, for `norms.pair_rows`
    norm_run: NormRun | None = None  # streamed trace: the norm engine's passes, run during the forward pass
    streamed: frozenset[str] = frozenset()  # streamed trace: the methods its layer sink served (α is gone)
    layer_rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # streamed: quantity → per layer
    # [B, K, n] target rows (`alpha`: [B, H, K, n])
    progress: Callable[[str, int, int], None] | None = None  # streamed: (phase, layers done, total), as they finish
    layer_fns: dict[str, list[LayerRowsFactory]] = field(default_factory=dict)  # streamed: quantity → per layer
    # a factory of the function positions [B, K'] → rows [B, K', n] of the matrix a rollout propagates through


def memo_of(trace: Trace) -> Memo:
    """The trace's memo, made on first use."""
    if trace.memo is None:
        trace.memo = Memo()
    memo: Memo = trace.memo
    return memo
