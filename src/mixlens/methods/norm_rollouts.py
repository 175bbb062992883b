"""Rollouts of the Kobayashi norm maps: the global N, N-Res and N-ResLN of the GlobEnc paper's comparison.

GlobEnc (Modarressi et al. 2022) ranks global attributions built the same way from each per-layer map M_l
(N = ‖Σ_h α^h_ij f^h(x_j)‖, N-Res = ‖t_ij‖, N-ResLN = ‖g_i(t_ij)‖; docs/DESIGN.md §3.3) by their Spearman
correlation with gradient × input: the plain product R_l = M_l R_{l−1}, R_0 = M_0, with no identity added and no row
normalisation (the aggregation GlobEnc's own code applies to every map, N-Enc included: `globenc_rollout`).
N has no residual term, so its product mixes tokens from layer 0 on; N-Res and N-ResLN carry the residual in
their diagonal. Full token × token mode only (not target-row mode).
"""

from __future__ import annotations

import torch

from mixlens.methods.engine import block_norms
from mixlens.methods.registry import register
from mixlens.methods.rollout import rollout
from mixlens.trace import Trace


@register("norm_rollout", engine=True, explains=True, unnormalised=True)
def norm_rollout(trace: Trace) -> torch.Tensor:
    """Rollout of N = ‖Σ_h α^h_ij f^h(x_j)‖ over layers 1..l (plain product, no residual): [B, L, n, n]."""
    return rollout(block_norms(trace).n)


@register("norm_res_rollout", engine=True, explains=True, unnormalised=True)
def norm_res_rollout(trace: Trace) -> torch.Tensor:
    """Rollout of N-Res = ‖t_ij‖ (attention plus residual) over layers 1..l (plain product): [B, L, n, n]."""
    return rollout(block_norms(trace).n_res)


@register("norm_resln_rollout", engine=True, explains=True, unnormalised=True)
def norm_resln_rollout(trace: Trace) -> torch.Tensor:
    """Rollout of N-ResLN = ‖g_i(t_ij)‖ (attention, residual, LayerNorm) over layers 1..l (plain product)."""
    return rollout(block_norms(trace).n_resln)
