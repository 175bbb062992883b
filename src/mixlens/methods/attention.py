"""Raw attention weights (W): α^h_ij per head, or the head mean ᾱ_ij (DESIGN §3.1)."""

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
    a = stacked_alpha(trace)
    return a if heads else a.mean(2)
