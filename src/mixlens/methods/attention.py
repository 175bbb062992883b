"""Raw attention weights (W): α^h_ij per head, or the head mean ᾱ_ij (docs/DESIGN.md §3.1)."""

from __future__ import annotations

import torch

from mixlens.methods.registry import LHTS, register
from mixlens.trace import Trace


def stacked_alpha(trace: Trace) -> torch.Tensor:
    """α of every layer, padded target rows zeroed: [batch, layer, head, target, source]."""
    a = torch.stack([lt.alpha for lt in trace.layers], dim=1).float()
    return a * trace.mask[:, None, None, :, None]


@register("attention", head_dims=LHTS)
def attention(trace: Trace, *, heads: bool = False) -> torch.Tensor:
    """Attention weights α (head mean unless heads=True)."""
    if heads:
        return stacked_alpha(trace)
    if trace.memo.alpha_mean is None:  # block_norms leaves it here as a by-product of its pass over α
        pair = trace.mask[:, :, None] & trace.mask[:, None, :]
        trace.memo.alpha_mean = torch.stack([lt.alpha.float().mean(1) * pair for lt in trace.layers], dim=1)
    return trace.memo.alpha_mean
