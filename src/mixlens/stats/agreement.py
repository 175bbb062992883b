"""Local vs global views of a head (Pascual et al. 2021): attention rows α^h_i· against head-attribution rows
c^{l,h}_i· = ‖∂o^{l,h}_i/∂x_j‖_F (normalised), compared per (layer, head) by Jensen–Shannon divergence, Pearson
and Spearman correlation over real keys, and the token-type masses of both maps (docs/DESIGN.md §3.7, §3.8).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from mixlens.methods.attention import stacked_alpha
from mixlens.methods.gradients import head_attribution, jacobian_norms
from mixlens.protocol import LensLike
from mixlens.stats.tokens import TOKEN_TYPES, token_kinds, token_type_masses

SCORES = ("js", "pearson", "spearman")


def _row_mask(mask: torch.Tensor, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key mask [B, 1.., 1, n], row mask [B, 1.., n]) as floats, for maps [B, ..., n, n] with `extra` middle axes."""
    m = mask.float()
    keys = m.view(m.shape[0], *([1] * extra), 1, -1)
    rows = m.view(m.shape[0], *([1] * extra), -1)
    return keys, rows


def js_rows(p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence (base 2, in [0, 1]) of each row pair over real keys: [B, ..., n, n] → [B, ..., n]."""
    keys, _ = _row_mask(mask, p.dim() - 3)
    p, q = p * keys, q * keys
    mid = (p + q) / 2

    def kl(a: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (a.clamp_min(1e-30) / mid.clamp_min(1e-30)).log2(), torch.zeros_like(a)).sum(-1)

    return (0.5 * kl(p) + 0.5 * kl(q)).clamp_min(0)


def pearson_rows(p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of each row pair over real keys: [B, ..., n, n] → [B, ..., n] (nan for constant rows)."""
    keys, _ = _row_mask(mask, p.dim() - 3)
    cnt = keys.sum(-1)
    pc = (p - (p * keys).sum(-1, keepdim=True) / cnt[..., None]) * keys
    qc = (q - (q * keys).sum(-1, keepdim=True) / cnt[..., None]) * keys
    den = (pc.pow(2).sum(-1) * qc.pow(2).sum(-1)).sqrt()
    return torch.where(den > 0, (pc * qc).sum(-1) / den.clamp_min(1e-30), torch.full_like(den, math.nan))


def _ranks(a: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n_b−1 of real keys within each row (padding sorted last; ties broken by order)."""
    filled = torch.where(keys > 0, a, torch.full_like(a, math.inf))
    return filled.argsort(-1).argsort(-1).to(a.dtype)


def spearman_rows(p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation of each row pair over real keys: [B, ..., n, n] → [B, ..., n]."""
    keys, _ = _row_mask(mask, p.dim() - 3)
    keys = keys.expand_as(p)
    return pearson_rows(_ranks(p, keys), _ranks(q, keys), mask)


@dataclass
class LocalGlobal:
    """Per (layer, head) means over all real rows of all inputs: `scores[name]` [L, H] for js/pearson/spearman,
    `local[type]` and `global_[type]` [L, H] token-type masses of attention and head attribution."""

    scores: dict[str, np.ndarray]
    local: dict[str, np.ndarray]
    global_: dict[str, np.ndarray]
    n_inputs: int
    n_rows: int
    params: dict[str, object] = field(default_factory=dict)

    def js_per_layer(self) -> np.ndarray:
        return self.scores["js"].mean(1)

    def dominant(self, view: str) -> np.ndarray:
        """Index into TOKEN_TYPES of the largest mass of each head [L, H] ('local' or 'global')."""
        masses = self.local if view == "local" else self.global_
        return np.stack([masses[t] for t in TOKEN_TYPES], -1).argmax(-1)

    def persistent_patterns(self, min_share: float = 0.5) -> dict[str, list[str]]:
        """Per view, the token types that dominate at least one head in ≥ `min_share` of the layers."""
        out = {}
        for view in ("local", "global"):
            dom = self.dominant(view)
            out[view] = [t for k, t in enumerate(TOKEN_TYPES) if (dom == k).any(1).mean() >= min_share]
        out["both"] = [t for t in out["local"] if t in out["global"]]
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "n_inputs": self.n_inputs,
            "n_rows": self.n_rows,
            "params": self.params,
            "scores": {k: v.tolist() for k, v in self.scores.items()},
            "js_per_layer": self.js_per_layer().tolist(),
            "masses": {
                "local": {k: v.tolist() for k, v in self.local.items()},
                "global": {k: v.tolist() for k, v in self.global_.items()},
            },
            "dominant": {
                "local": [[TOKEN_TYPES[i] for i in r] for r in self.dominant("local")],
                "global": [[TOKEN_TYPES[i] for i in r] for r in self.dominant("global")],
            },
            "same_dominant_share": float((self.dominant("local") == self.dominant("global")).mean()),
            "persistent": self.persistent_patterns(),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json())


def compare_local_global(
    lens: LensLike,
    texts: Iterable,
    *,
    batch_size: int = 8,
    max_length: int | None = None,
    input: str = "word",
    mode: str = "estimate",
    probes: int = 16,
    seed: int = 0,
    on_batch: Callable[[float], None] | None = None,
) -> LocalGlobal:
    """Average the local-vs-global comparison over `texts` (an iterable of str or (str, str)), batch by batch.
    `on_batch(n)`: n inputs more are done — fractions of a batch as its JVP chunks finish (the shares of a batch
    add up to its size)."""
    sums: dict[str, torch.Tensor] = {}
    n_inputs = n_rows = 0
    batch: list = []

    def flush() -> None:
        nonlocal n_inputs, n_rows
        [bt] = lens.batches(batch, len(batch), max_length, trace=True)
        tr = bt.trace
        assert tr is not None  # trace=True
        attn = stacked_alpha(tr)  # [B, L, H, n, n]
        if on_batch:  # the JVPs are most of the time: advance as their chunks finish, not once per batch
            share = len(batch) * 0.99
            jacobian_norms(tr, input=input, mode=mode, probes=probes, seed=seed, on_chunk=lambda s: on_batch(s * share))
        glob = head_attribution(tr, input=input, mode=mode, probes=probes, seed=seed).values  # memoised norms
        mask = tr.mask
        rows = mask.float()[:, None, None, :]  # [B, 1, 1, n]
        per_row = {
            "js": js_rows(attn, glob, mask),
            "pearson": pearson_rows(attn, glob, mask),
            "spearman": spearman_rows(attn, glob, mask),
        }
        for k, v in per_row.items():  # nan rows (constant maps, e.g. 1-key causal rows) are left out
            ok = rows.expand_as(v) * ~v.isnan()
            sums[k] = sums.get(k, 0) + (v.nan_to_num() * ok).sum((0, 3))
            sums[k + "#"] = sums.get(k + "#", 0) + ok.sum((0, 3))
        kinds = token_kinds(lens, tr.inputs["input_ids"], mask)
        lens_rows = mask.sum(-1).float()[:, None, None]  # token_type_masses averages over rows: re-weight by rows
        for view, maps in (("local", attn), ("global", glob)):
            for t, v in token_type_masses(maps, kinds, mask).items():
                sums[f"{view}.{t}"] = sums.get(f"{view}.{t}", 0) + (v * lens_rows).sum(0)
        n_inputs += len(batch)
        n_rows += int(mask.sum())
        if on_batch:
            on_batch(len(batch) * 0.01)
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    if not n_inputs:
        from mixlens.errors import MixlensError

        raise MixlensError("no input text to compare")
    scores = {k: (sums[k] / sums[k + "#"].clamp_min(1)).numpy() for k in SCORES}
    local = {t: (sums[f"local.{t}"] / n_rows).numpy() for t in TOKEN_TYPES}
    glob_m = {t: (sums[f"global.{t}"] / n_rows).numpy() for t in TOKEN_TYPES}
    return LocalGlobal(
        scores,
        local,
        glob_m,
        n_inputs,
        n_rows,
        {"model": lens.name, "input": input, "mode": mode, "probes": probes, "seed": seed},
    )
