"""Layer-level quantities of Kobayashi et al. 2021 beyond the per-token mixing ratio (docs/DESIGN.md §3.4)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
from scipy.stats import spearmanr

from mixlens.adapters import Adapter


@torch.no_grad()
def expansion_rate(adapter: Adapter) -> torch.Tensor:
    """‖F^h‖_F / √(d+1) of each head's affine value map f^h(x) = (x W_V^h + b_V^h) W_O^h, written as the
    (d+1)×(d+1) matrix [[W_V^h W_O^h, 0], [b_V^h W_O^h, 1]] → [layer, head].

    ‖W_V^h W_O^h‖_F² = tr((W_V^hᵀ W_V^h)(W_O^h W_O^hᵀ)) avoids forming the d×d product.
    """
    out = []
    for lay in adapter.layers:
        dh, rep = lay.d_head, lay.n_heads // lay.n_kv_heads
        d = lay.w_o.shape[1]
        rates = []
        for h in range(lay.n_heads):
            g = h // rep  # grouped-query attention: value head shared by `rep` query heads
            wv = lay.w_v[:, g * dh : (g + 1) * dh].double()
            wo = lay.w_o[h * dh : (h + 1) * dh].double()
            sq = torch.trace((wv.T @ wv) @ (wo @ wo.T)) + 1.0
            if lay.b_v is not None:
                sq = sq + (lay.b_v[g * dh : (g + 1) * dh].double() @ wo).pow(2).sum()
            rates.append(torch.sqrt(sq / (d + 1)))
        out.append(torch.stack(rates))
    return torch.stack(out).float()


def frequency_rank_correlation(ratio: np.ndarray, tokens: Sequence[Sequence[str]]) -> np.ndarray:
    """Spearman ρ between per-token mixing ratio and the token's frequency rank in `tokens` (rank 1 = most
    frequent), per layer. ratio [batch, layer, target] (padding ignored) → [layer]."""
    counts = Counter(t for seq in tokens for t in seq)
    rank = {t: r for r, (t, _) in enumerate(counts.most_common(), start=1)}
    ranks = np.array([rank[t] for seq in tokens for t in seq], dtype=float)
    per_layer = []
    for layer in range(ratio.shape[1]):
        vals = np.concatenate([ratio[b, layer, : len(seq)] for b, seq in enumerate(tokens)])
        per_layer.append(spearmanr(vals, ranks).statistic)
    return np.array(per_layer)
