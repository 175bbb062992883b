"""Attention pattern types of Kovaleva et al. 2019: vertical, diagonal, vertical+diagonal, block, heterogeneous.

A deterministic rule-based classifier of one head's map A over the real tokens of one input (n×n, rows
summing to 1). Three scores, each rescaled so that a uniform map scores 0 and a pure pattern scores 1
(`excess(s) = (s − s_uniform) / (1 − s_uniform)`, clipped to [0, 1]):

- `diagonal`: mean_i Σ_{|i−j|≤1} A_ij, the mass on the band of self, previous and next token;
- `vertical`: Σ_{j∈V} mean_i A'_ij for the `top_k` columns V with the largest column mean of A', where A'
  is A with the band removed (so a diagonal cannot pose as columns);
- `block`: mean_i Σ_{j: seg(j)=seg(i)} A_ij, mass kept inside the query's own segment (segments split
  after each separator token; only defined for inputs with two or more segments, else 0). It is tested
  after diagonal and vertical, which also stay mostly inside a segment.

Rules, in order (default thresholds in `Thresholds`): vertical+diagonal if diagonal ≥ `mix_diag` and
vertical ≥ `mix_vert`; diagonal if diagonal ≥ `diag`; vertical if vertical ≥ `vert`; block if block ≥
`block`; else heterogeneous. The thresholds were set on the labelled real maps of tests/data (see
docs/guides/bertology.md for the agreement), the rules on synthetic maps of known type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mixlens.protocol import LensLike
from mixlens.stats.heads import view_maps
from mixlens.stats.tokens import token_kinds

PATTERNS = ("vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous")


@dataclass(frozen=True)
class Thresholds:
    diag: float = 0.3
    vert: float = 0.35
    mix_diag: float = 0.1
    mix_vert: float = 0.15
    block: float = 0.5
    top_k: int = 2


def _excess(score: float, uniform: float) -> float:
    return float(np.clip((score - uniform) / (1 - uniform), 0, 1)) if uniform < 1 else 0.0


def _scores_raw(a: np.ndarray, seg: np.ndarray | None, top_k: int) -> tuple[float, float, float]:
    n = a.shape[0]
    idx = np.arange(n)
    band = np.abs(idx[:, None] - idx[None, :]) <= 1
    diag = float((a * band).sum(1).mean())
    off = np.where(band, 0.0, a)
    vert = float(np.sort(off.mean(0))[::-1][:top_k].sum())
    block = 0.0
    if seg is not None and len(np.unique(seg)) > 1:
        block = float((a * (seg[:, None] == seg[None, :])).sum(1).mean())
    return diag, vert, block


def pattern_scores(a: np.ndarray, segments: Sequence[int] | None = None, top_k: int = 2) -> dict[str, float]:
    """Chance-corrected scores (uniform map → 0, pure pattern → 1) of one map a [n, n] (real tokens only)."""
    a = np.asarray(a, dtype=float)
    n = a.shape[0]
    seg = None if segments is None else np.asarray(segments)
    d, v, b = _scores_raw(a, seg, top_k)
    ud, uv, ub = _scores_raw(np.full((n, n), 1.0 / n), seg, top_k)
    return {
        "diagonal": _excess(d, ud),
        "vertical": _excess(v, uv),
        "block": _excess(b, ub) if seg is not None and len(np.unique(seg)) > 1 else 0.0,
    }


def classify(a: np.ndarray, segments: Sequence[int] | None = None, th: Thresholds = Thresholds()) -> str:
    """The pattern type of one attention map a [n, n] (real tokens only; rows sum to 1)."""
    s = pattern_scores(a, segments, th.top_k)
    if s["diagonal"] >= th.mix_diag and s["vertical"] >= th.mix_vert:
        return "vertical+diagonal"
    if s["diagonal"] >= th.diag:
        return "diagonal"
    if s["vertical"] >= th.vert:
        return "vertical"
    if s["block"] >= th.block:
        return "block"
    return "heterogeneous"


def segments_from_separators(is_sep: Sequence[bool] | np.ndarray) -> list[int]:
    """Segment id per token: a new segment starts after each separator (the separator ends its segment)."""
    out, cur = [], 0
    for s in is_sep:
        out.append(cur)
        cur += bool(s)
    return out


def pattern_shares(labels: np.ndarray) -> np.ndarray:
    """Share of each type in PATTERNS per layer: labels [inputs, L, H] of str → [L, len(PATTERNS)]."""
    return np.stack([(labels == p).mean((0, 2)) for p in PATTERNS], -1)


def classify_inputs(
    lens: LensLike,
    texts,
    *,
    view: str = "attn",
    batch_size: int = 32,
    max_length: int | None = None,
    th: Thresholds = Thresholds(),
    on_batch=None,
) -> np.ndarray:
    """Pattern type of every head on every input: → [inputs, L, H] of str (in input order)."""
    import torch

    out: list = [None] * len(texts)
    for bt in lens.batches(list(texts), max(1, batch_size), max_length, order="length", trace=["attention"]):
        assert bt.trace is not None  # a traced batch
        with torch.no_grad():
            maps = view_maps(bt.trace, view).cpu().numpy()
        seps = token_kinds(lens, bt.enc.inputs["input_ids"], bt.trace.mask)["sep"].numpy()
        for b, n in enumerate(bt.trace.lengths):
            seg = segments_from_separators(seps[b, :n])
            out[bt.index[b]] = [
                [classify(maps[b, la, h, :n, :n], seg, th) for h in range(maps.shape[2])] for la in range(maps.shape[1])
            ]
        if on_batch:
            on_batch(len(bt.index))
    return np.array(out, dtype=object)
