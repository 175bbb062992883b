"""Per-head BERTology statistics over a dataset (Clark et al. 2019; Kovaleva et al. 2019; DESIGN §3.8).

Every statistic is computed on two views of each head's map, both with rows summing to 1:

- `attn`: the attention weights α^h_ij;
- `norm`: the norm-based contributions ‖α^h_ij f^h(x_j)‖ (Kobayashi et al. 2020), rows renormalised.

Per (layer, head), per input (then the mean over inputs):

- `{view}_{cls,sep,punct,self,prev,next}`: mean over the input's real query rows i of Σ_{j∈S} A_ij;
- `{view}_entropy`: mean over real rows of the entropy (nats) of rows smoothed as 0.9999 A + 0.0001/n;
- `{view}_{cls,sep,punct}_colmax` (Kovaleva): the column mean over real rows, mean_i A_ij, of every
  occurrence j of the token type, max over occurrences; inputs without the type are left out of the mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from mixlens.errors import MixlensError
from mixlens.methods.attention import stacked_alpha
from mixlens.methods.engine import head_vectors
from mixlens.protocol import LensLike
from mixlens.stats.clustering import js_divergence_sums
from mixlens.stats.tokens import TOKEN_TYPES, row_entropy, token_kinds, token_type_masses
from mixlens.trace import Trace

VIEWS = ("attn", "norm")
COLMAX_TYPES = ("cls", "sep", "punct")
STATISTICS = (*TOKEN_TYPES, "entropy")  # the required columns, per view
SMOOTH = 1e-4


def view_maps(trace: Trace, view: str) -> torch.Tensor:
    """Per-head maps of one view with rows summing to 1 (padded rows 0): [B, L, H, n, n]."""
    if view == "attn":
        return stacked_alpha(trace)
    if view == "norm":  # α^h_ij ‖f^h(x_j)‖, the per-head `norm` method, without the head-summed extras
        f_norm = torch.stack(
            [head_vectors(lt, lay).norm(dim=-1) for lt, lay in zip(trace.layers, trace.adapter.layers, strict=True)], 1
        )  # [B, L, H, n]
        a = stacked_alpha(trace) * f_norm[:, :, :, None, :]
        return a / a.sum(-1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)
    raise MixlensError(f"unknown view '{view}'; valid: {', '.join(VIEWS)}")


def column_max(maps: torch.Tensor, where: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Kovaleva's per-head score: max over source positions j in `where` of the column mean over real
    rows. maps [B, ..., n, n], where/mask [B, n] bool → [B, ...] (NaN for inputs where `where` is empty)."""
    extra = maps.dim() - 3
    shape = (mask.shape[0], *([1] * extra), -1)
    m = mask.float().view(*shape)
    col = (maps.float() * m.unsqueeze(-1)).sum(-2) / m.sum(-1, keepdim=True).clamp_min(1)  # [B, ..., n]
    col = col.masked_fill(~where.view(*shape), float("-inf")).amax(-1)
    return col.masked_fill(torch.isinf(col), float("nan"))


def input_statistics(
    maps: torch.Tensor, kinds: dict[str, torch.Tensor], mask: torch.Tensor, smooth: float = SMOOTH
) -> dict[str, torch.Tensor]:
    """All per-head statistics of one view for each input: maps [B, L, H, n, n] → {name: [B, L, H]}."""
    out = dict(token_type_masses(maps, kinds, mask))
    out["entropy"] = row_entropy(maps, mask, smooth)
    for k in COLMAX_TYPES:
        out[f"{k}_colmax"] = column_max(maps, kinds[k], mask)
    return out


class _Mean:
    """NaN-aware running mean of [L, H] arrays over inputs."""

    def __init__(self) -> None:
        self.total: dict[str, np.ndarray] = {}
        self.count: dict[str, np.ndarray] = {}

    def add(self, values: dict[str, torch.Tensor]) -> None:
        for k, v in values.items():
            a = v.detach().cpu().double().numpy()
            ok = ~np.isnan(a)
            self.total[k] = self.total.get(k, 0) + np.where(ok, a, 0).sum(0)
            self.count[k] = self.count.get(k, 0) + ok.sum(0)

    def mean(self) -> dict[str, np.ndarray]:
        return {
            k: np.where(self.count[k] > 0, self.total[k] / np.maximum(self.count[k], 1), np.nan) for k in self.total
        }


@dataclass
class HeadReport:
    """Result of `head_statistics`: `table` has one row per (layer, head) (0-based `layer`, `head`) and one
    column per `{view}_{statistic}`; `js[view]` [L·H, L·H] is the mean Jensen–Shannon divergence between
    heads (nats, pooled over the real query rows of the clustered inputs), head k = layer·H + head."""

    table: pd.DataFrame
    js: dict[str, np.ndarray]
    n_inputs: int
    model: str

    def layer_summary(self) -> pd.DataFrame:
        """Per-layer mean over heads of every statistic."""
        return self.table.drop(columns="head").groupby("layer").mean().reset_index()

    def grid(self, column: str) -> np.ndarray:
        """One statistic as a [layer, head] array."""
        if column not in self.table:
            raise MixlensError(f"no statistic '{column}'; have {', '.join(self.table.columns[2:])}")
        t = self.table.sort_values(["layer", "head"])
        return t[column].to_numpy().reshape(t["layer"].max() + 1, -1)


def head_statistics(
    lens: LensLike,
    texts: Sequence,
    *,
    views: Sequence[str] = VIEWS,
    batch_size: int = 32,
    max_length: int | None = None,
    clustering: bool = True,
    cluster_limit: int = 200,
    on_batch: Callable[[int], None] | None = None,
) -> HeadReport:
    """Per-head statistics over `texts` and, with `clustering`, JS divergences between heads over the first
    `cluster_limit` texts (pairwise JS costs L²H²n² per input)."""
    for v in views:
        if v not in VIEWS:
            raise MixlensError(f"unknown view '{v}'; valid: {', '.join(VIEWS)}")
    means = {v: _Mean() for v in views}
    js: dict[str, torch.Tensor | None] = {v: None for v in views}
    rows = 0
    n_inputs = 0
    # longest first, less padding; the means do not care about order. JS on the first `cluster_limit` inputs only
    for bt in lens.batches(list(texts), max(1, batch_size), max_length, order="length", trace=["attention"]):
        assert bt.trace is not None  # a traced batch
        mask = bt.trace.mask.cpu()
        kinds = token_kinds(lens, bt.enc.inputs["input_ids"], mask)
        sel = torch.as_tensor(bt.index) < cluster_limit
        with torch.no_grad():
            for v in views:
                maps = view_maps(bt.trace, v).cpu()
                means[v].add(input_statistics(maps, kinds, mask))
                if clustering and sel.any():
                    s = js_divergence_sums(maps[sel].flatten(1, 2), mask[sel]).sum(0)
                    prev = js[v]
                    js[v] = s if prev is None else prev + s
        rows += int(mask[sel].sum())
        n_inputs += len(bt.index)
        if on_batch:
            on_batch(len(bt.index))
    first = next(iter(means.values())).mean()
    n_layers, n_heads = first["cls"].shape
    table = pd.DataFrame(
        {"layer": np.repeat(np.arange(n_layers), n_heads), "head": np.tile(np.arange(n_heads), n_layers)}
    )
    for v in views:
        stats = means[v].mean()
        for k in (*STATISTICS, *(f"{t}_colmax" for t in COLMAX_TYPES)):
            table[f"{v}_{k}"] = stats[k].reshape(-1)
    js_mean = {v: (s / rows).numpy() for v, s in js.items() if s is not None}
    return HeadReport(table, js_mean, n_inputs, lens.name)


@torch.no_grad()
def attention_similarity(
    lens_a: LensLike,
    lens_b: LensLike,
    texts: Sequence,
    *,
    batch_size: int = 32,
    max_length: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Fine-tuning change: per (layer, head) cosine similarity of the two models' attention maps (the real
    n×n block of each input flattened), mean over inputs → [L, H]. Both models must share a tokenizer."""
    a_l, b_l = lens_a.adapter, lens_b.adapter
    if (a_l.n_layers, a_l.n_heads) != (b_l.n_layers, b_l.n_heads):
        raise MixlensError(
            f"the models differ in shape: {a_l.n_layers}×{a_l.n_heads} vs {b_l.n_layers}×{b_l.n_heads} (layers × heads)"
        )
    if lens_a.tokenizer.get_vocab() != lens_b.tokenizer.get_vocab():
        raise MixlensError("the two models use different vocabularies; their attention maps cannot be compared")
    total: torch.Tensor | None = None
    n_inputs = 0
    for bt in lens_a.batches(list(texts), max(1, batch_size), max_length, order="length", trace=["attention"]):
        assert bt.trace is not None  # a traced batch
        ma = stacked_alpha(bt.trace).flatten(-2)  # [B, L, H, n·n]; pad rows/columns are 0 in both
        mb = stacked_alpha(lens_b.trace(bt.enc, to_output=False)).flatten(-2)
        s = torch.nn.functional.cosine_similarity(ma, mb, dim=-1).sum(0)
        total = s if total is None else total + s
        n_inputs += len(bt.index)
        if on_batch:
            on_batch(len(bt.index))
    if total is None:
        raise MixlensError("no input text given")
    return (total / n_inputs).numpy()
