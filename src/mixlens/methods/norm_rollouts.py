"""Rollouts of the Kobayashi norm maps: the global N, N-Res and N-ResLN of the GlobEnc paper's comparison.

GlobEnc (Modarressi et al. 2022) ranks global attributions built the same way from each per-layer map M_l
(N = ‖Σ_h α^h_ij f^h(x_j)‖, N-Res = ‖t_ij‖, N-ResLN = ‖g_i(t_ij)‖; docs/DESIGN.md §3.3) by their Spearman
correlation with gradient × input: the plain product R_l = M_l R_{l−1}, R_0 = M_0, with no identity added and no row
normalisation (the aggregation GlobEnc's own code applies to every map, N-Enc included: `globenc_rollout`).
N has no residual term, so its product mixes tokens from layer 0 on; N-Res and N-ResLN carry the residual in
their diagonal.

Row mode (`Method.row_mode`): row t of R_l is e_t M_l ⋯ M_0, propagated down the layers from the rows of
each M_m (`rollout.rollout_rows`), never forming an n × n product. Those rows come from the norm engine: in a
streamed trace from what its layer step kept (`norms.stream_layer`; in row mode, a causal LM's q and K), otherwise
from the token pass `block_norms` kept (`norms.pair_rows`).
"""

from __future__ import annotations

from typing import Any

import torch

from mixlens.adapters import Family
from mixlens.methods.attention import rows_of
from mixlens.methods.engine import block_norms, pair_rows
from mixlens.methods.memo import LayerRowsFactory, RowsFn, StreamLayer
from mixlens.methods.registry import ROLLOUT_MEMORY, TRACED, Card, Stream, register
from mixlens.methods.rollout import LayerRows, kept_matrices, rollout, rollout_rows, row_pair_mask
from mixlens.trace import Trace

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("global.md", "whole-layer and global attribution")

NORM_MAPS = "norm_maps"  # the key of the norm rollouts' layer sink
MAPS = ("n", "n_res", "n_resln")  # the engine's pair maps (`memo.PairRows` fields) the rollouts propagate through


def _kept(name: str) -> str:
    """What the layer sink keeps of map `name` (`layer_fns` key)."""
    return f"{NORM_MAPS}.{name}"


def stream_layer(s: StreamLayer, whole: bool) -> None:
    """The layer sink of a streamed trace (`registry.Stream`): for each of N, N-Res and N-ResLN, the factory of its
    rows at any positions (padding pairs 0), from the norm engine's layer step (`StreamLayer.pairs`)."""
    if s.pairs is None:  # the engine streams rows of every position only for a `whole` stream
        return
    pairs, mask = s.pairs, s.mask

    def factory(name: str) -> LayerRowsFactory:
        def rows_of(rows: torch.Tensor) -> torch.Tensor:
            return getattr(pairs(rows), name) * row_pair_mask(mask, rows)

        return lambda: rows_of

    for name in MAPS:
        s.keep_fn(_kept(name), factory(name))


def _engine(family: Family) -> bool:
    return True


STREAM = Stream(NORM_MAPS, stream_layer, whole=True, norm_run=_engine)


def _norm_rollout(trace: Trace, name: str) -> torch.Tensor:
    """The rollout of the engine's per-layer map `name` ('n', 'n_res' or 'n_resln'): [B, L, n, n], or its target
    rows [B, L, K, n] in row mode."""
    bn = block_norms(trace)  # the per-run exactness check (a streamed trace: its passes ran in the forward pass)
    rows = rows_of(trace)
    if rows is None:
        return rollout(getattr(bn, name))

    def from_token_pass(m: int) -> RowsFn:
        return lambda rows: getattr(pair_rows(trace, m, rows), name)[:, 0] * row_pair_mask(trace.mask, rows)

    layer_rows: LayerRows = kept_matrices(trace, _kept(name)) or from_token_pass
    return rollout_rows(trace, layer_rows, rows)


def _declared(definition: str) -> dict[str, Any]:
    """What the three norm rollouts declare alike (norm engine, explain, unnormalised, row mode streamed layer by
    layer), with the card's `definition`."""
    return {
        "engine": True,
        "explains": True,
        "unnormalised": True,
        "row_mode": True,
        "stream": STREAM,
        "card": Card(
            definition=definition,
            passes=TRACED + " (norm engine).",
            memory=ROLLOUT_MEMORY + ".",
            background=BACKGROUND,
        ),
    }


@register("norm_rollout", **_declared("R_l = N_l R_{l−1}, N = ‖Σ_h α^h_ij f^h(x_j)‖ (plain product, no residual)."))
def norm_rollout(trace: Trace) -> torch.Tensor:
    """Rollout of N = ‖Σ_h α^h_ij f^h(x_j)‖ over layers 1..l (plain product, no residual): [B, L, n, n]."""
    return _norm_rollout(trace, "n")


@register("norm_res_rollout", **_declared("R_l = N_l R_{l−1}, N = N-Res = ‖t_ij‖ (plain product)."))
def norm_res_rollout(trace: Trace) -> torch.Tensor:
    """Rollout of N-Res = ‖t_ij‖ (attention plus residual) over layers 1..l (plain product): [B, L, n, n]."""
    return _norm_rollout(trace, "n_res")


@register("norm_resln_rollout", **_declared("R_l = N_l R_{l−1}, N = N-ResLN = ‖g_i(t_ij)‖ (plain product)."))
def norm_resln_rollout(trace: Trace) -> torch.Tensor:
    """Rollout of N-ResLN = ‖g_i(t_ij)‖ (attention, residual, LayerNorm) over layers 1..l (plain product)."""
    return _norm_rollout(trace, "n_resln")
