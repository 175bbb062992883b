"""Raw attention weights (W): α^h_ij per head, or the head mean ᾱ_ij (docs/DESIGN.md §3.1)."""

from __future__ import annotations

import torch

from mixlens.methods.memo import memo_of
from mixlens.methods.registry import LHTS, TRACED, Card, register
from mixlens.trace import LayerTrace, Trace

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("api.md", "the Python API")

ALPHA_MEAN = "alpha_mean"  # memo key: the head-mean α [B, L, n, n] (also a by-product of the norm engine)


def rows_of(trace: Trace) -> torch.Tensor | None:
    """The target positions [batch, K] that methods compute rows for (`run_methods(rows=...)`); None: all rows."""
    return memo_of(trace).rows


def alpha_rows(alpha: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Target rows of α [B, H, n, n] at positions rows [B, K] → [B, H, K, n]."""
    b, h, _, n = alpha.shape
    return alpha.gather(2, rows[:, None, :, None].expand(b, h, rows.shape[1], n))


def target_alpha(trace: Trace, index: int) -> torch.Tensor:
    """The target rows of layer `index`'s α [B, H, K, n]: kept by the layer sink of a streamed trace, else gathered."""
    kept = memo_of(trace).layer_rows.get("alpha")
    if kept is not None:
        return kept[index]
    rows = rows_of(trace)
    assert rows is not None, "target rows of a trace in row mode"
    return trace.layers[index].alpha_rows(rows)  # from α, or in row mode from q and K (no [B, H, n, n])


def stacked_alpha(trace: Trace) -> torch.Tensor:
    """α of every layer, padded target rows zeroed: [batch, layer, head, target, source] (target: the rows of
    `rows_of(trace)` when set)."""
    rows = rows_of(trace)
    if rows is not None:
        return torch.stack([target_alpha(trace, i) for i in range(len(trace.layers))], dim=1)
    a = torch.stack([_full_alpha(trace, lt) for lt in trace.layers], dim=1).float()
    return a * trace.mask[:, None, None, :, None]


def _full_alpha(trace: Trace, lt: LayerTrace) -> torch.Tensor:
    """α [B, H, n, n] of one layer: as traced, or (a row-mode trace, asked for every row) rebuilt from q and K."""
    if lt.qk is None:
        return lt.alpha
    bsz, n = trace.mask.shape
    return lt.alpha_rows(torch.arange(n, device=trace.mask.device).expand(bsz, n))


@register(
    "attention",
    head_dims=LHTS,
    row_mode=True,
    explains=True,
    qk_rows=True,
    default_in={"analyze": 0},
    group="mixing-ratio",
    card=Card(
        definition="α^h_ij = softmax_j(q_i·k_j / √d_h + mask), the model's own attention probabilities; head mean "
        "(1/H) Σ_h α^h_ij unless heads=True.",
        passes=TRACED + ".",
        memory="[L, H, n, n] while traced; on a causal LM read by rows from q, K and the softmax normaliser (row "
        "mode, no [H, n, n]); output [L, n, n] or [L, H, n, n].",
        background=BACKGROUND,
    ),
)
def attention(trace: Trace, *, heads: bool = False) -> torch.Tensor:
    """Attention weights α (head mean unless heads=True)."""
    if heads:
        return stacked_alpha(trace)
    memo = memo_of(trace)
    kept: torch.Tensor | None = memo.get(ALPHA_MEAN)  # block_norms leaves it as a by-product of its pass over α
    if kept is None:
        if rows_of(trace) is not None:
            return stacked_alpha(trace).mean(2)
        pair = trace.mask[:, :, None] & trace.mask[:, None, :]
        means = [_full_alpha(trace, lt).float().mean(1) * pair for lt in trace.layers]
        kept = memo.put(ALPHA_MEAN, torch.stack(means, dim=1))
    return kept
