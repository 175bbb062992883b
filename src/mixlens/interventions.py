"""Disabling heads and layers with our own hooks (transformers 5 removed `head_mask`; DESIGN §3.8).

Modes, for the selected heads of one layer:

- `uniform` (Kovaleva et al. 2019): α^h_ij ← 1/|K_i| over the allowed keys K_i (non-pad keys; for causal
  decoders also j ≤ i). The head's context becomes the mean of its allowed value vectors.
- `zero`: the head's context z^h_i = Σ_j α^h_ij v^h_j ← 0 (its output through W_O vanishes; b_O stays), by
  α^h ← 0, so that a trace records the weights the model used and decompositions of it stay exact.
- `mean`: z^h_i ← the mean context of that head over the real tokens of a reference dataset.

A whole layer is all of its heads. Edits go through the engine's edit points `blocks.{l}.attn.pattern`
[B, H, n, n] and `blocks.{l}.attn.z` [B, H, n, d_h] (mixlens.trace). The head/layer sweep over a task metric
is in `mixlens.bertology.sweep`.

Head sets are written `L5H8,L0H9` (`L3` = every head of layer 3): `parse_heads` turns one into ablations,
`format_heads` back; `with disabled(lens, ablations):` disables them in every trace, analysis and sweep of the lens.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mixlens.errors import MixlensError
from mixlens.protocol import LensLike
from mixlens.trace import Edit, Trace, default_edits, repeat_kv

MODES = ("uniform", "zero", "mean")


@dataclass(frozen=True)
class Ablation:
    """Disable `heads` of `layer` (None = every head: the whole layer) with `mode`."""

    layer: int
    heads: tuple[int, ...] | None = None
    mode: str = "uniform"


def _check(lens: LensLike, ablations: Sequence[Ablation], means: torch.Tensor | None) -> None:
    n_layers, n_heads = lens.adapter.n_layers, lens.adapter.n_heads
    for a in ablations:
        if a.mode not in MODES:
            raise MixlensError(f"unknown ablation mode '{a.mode}'; valid: {', '.join(MODES)}")
        if not 0 <= a.layer < n_layers:
            raise MixlensError(f"layer {a.layer} out of range (the model has {n_layers} layers, 0-based)")
        if a.heads is not None and any(not 0 <= h < n_heads for h in a.heads):
            raise MixlensError(f"head out of range in {list(a.heads)} (the model has {n_heads} heads, 0-based)")
        if a.mode == "mean" and means is None:
            raise MixlensError("mean ablation needs head means (see mixlens.bertology.sweep.head_means)")


def _selection(groups: Sequence[tuple[int, ...] | None], n_heads: int) -> torch.Tensor:
    """[K, H] bool: copy k of the batch ablates heads groups[k] (None = all)."""
    sel = torch.zeros(len(groups), n_heads, dtype=torch.bool)
    for k, g in enumerate(groups):
        sel[k, list(range(n_heads)) if g is None else list(g)] = True
    return sel


def _uniform(mask: torch.Tensor, n: int, causal: bool) -> torch.Tensor:
    """Uniform rows over allowed keys: mask [B, n] → [B, 1, n, n]."""
    allowed = mask[:, None, None, :n].float().expand(-1, 1, n, n)
    if causal:
        allowed = allowed * torch.ones(n, n, device=mask.device).tril()
    return allowed / allowed.sum(-1, keepdim=True).clamp_min(1)


def _compose(outer: Edit, inner: Edit) -> Edit:
    """outer ∘ inner: two ablations of the same edit point, applied in order."""
    return lambda t: outer(inner(t))


def _edit(sel: torch.Tensor, replacement: Callable[[torch.Tensor], torch.Tensor]) -> Edit:
    """An edit on [K·B, H, ...] that replaces the selected heads of copy k by `replacement(t)` ([B or 1, H
    or 1, ...], broadcast)."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        k = sel.shape[0]
        view = t.view(k, t.shape[0] // k, *t.shape[1:])
        s = sel.to(t.device).view(k, 1, sel.shape[1], *([1] * (t.dim() - 2)))
        return torch.where(s, replacement(t).to(t.dtype), view).view_as(t)

    return fn


def edits_for(
    lens: LensLike,
    layer: int,
    groups: Sequence[tuple[int, ...] | None],
    mode: str,
    mask: torch.Tensor,
    means: torch.Tensor | None = None,
) -> dict[str, Edit]:
    """Edits ablating, in copy k of a batch stacked len(groups) times, the heads groups[k] of `layer`.

    mask [B, n] (of ONE copy); means [L, H, d_h] for mode 'mean'.
    """
    sel = _selection(groups, lens.adapter.n_heads)
    if mode == "uniform":
        causal = lens.adapter.family.causal
        return {f"blocks.{layer}.attn.pattern": _edit(sel, lambda t: _uniform(mask.to(t.device), t.shape[-1], causal))}
    if mode == "zero":  # α^h ← 0 gives z^h = 0 exactly, and a trace records the α the model used
        return {f"blocks.{layer}.attn.pattern": _edit(sel, lambda t: torch.zeros((), device=t.device))}
    if mode == "mean":
        if means is None:
            raise MixlensError("mean ablation needs head means (see mixlens.bertology.sweep.head_means)")
        head_means = means[layer]  # [H, d_h]
        return {f"blocks.{layer}.attn.z": _edit(sel, lambda t: head_means.to(t.device)[None, :, None, :])}
    raise MixlensError(f"unknown ablation mode '{mode}'; valid: {', '.join(MODES)}")


def merged_edits(
    lens, ablations: Sequence[Ablation], mask: torch.Tensor, means: torch.Tensor | None = None
) -> dict[str, Edit]:
    """Edits applying all `ablations` to one (unstacked) batch; several ablations of a layer compose."""
    _check(lens, ablations, means)
    edits: dict[str, Edit] = {}
    for a in ablations:
        for name, fn in edits_for(lens, a.layer, [a.heads], a.mode, mask, means).items():
            prev = edits.get(name)
            edits[name] = fn if prev is None else _compose(fn, prev)
    return edits


def ablated_trace(lens: LensLike, enc, ablations: Sequence[Ablation], means: torch.Tensor | None = None) -> Trace:
    """`lens.trace` with the heads/layers of `ablations` disabled (the trace records the edited α)."""
    if not hasattr(enc, "inputs"):
        enc = lens.encode(enc)
    return lens.trace(enc, edits=merged_edits(lens, ablations, enc.inputs["attention_mask"].bool(), means))


def head_contexts(trace: Trace) -> torch.Tensor:
    """z^h_i = Σ_j α^h_ij v^h_j of every layer (before W_O): [B, L, H, n, d_h]."""
    return torch.stack([torch.matmul(lt.alpha, repeat_kv(lt.value, lt.alpha.shape[1])) for lt in trace.layers], 1)


_HEAD = re.compile(r"L(\d+)(?:H(\d+))?")


def parse_heads(spec: str, lens, mode: str = "zero") -> list[Ablation]:
    """`"L5H8,L0H9,L3"` → one `Ablation` per layer (heads ascending; `L3` = the whole layer), checked against
    the model of `lens`. Empty → []."""
    n_layers, n_heads = lens.adapter.n_layers, lens.adapter.n_heads
    by_layer: dict[int, set[int] | None] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        m = _HEAD.fullmatch(item.upper())
        if m is None:
            raise MixlensError(f"bad head '{item}'; expected L<layer>H<head> or L<layer>, e.g. L5H8,L0H9")
        layer = int(m[1])
        if layer >= n_layers:
            raise MixlensError(f"unknown layer in '{item}': the model has layers L0..L{n_layers - 1}")
        if m[2] is None:
            by_layer[layer] = None
            continue
        head = int(m[2])
        if head >= n_heads:
            raise MixlensError(f"unknown head in '{item}': the model has heads H0..H{n_heads - 1}")
        heads = by_layer.setdefault(layer, set())
        if heads is not None:
            heads.add(head)
    out = [Ablation(la, None if hs is None else tuple(sorted(hs)), mode) for la, hs in sorted(by_layer.items())]
    _check(lens, out, torch.zeros(()))  # the mode (means for mode 'mean' come with the edits)
    return out


def format_heads(heads: Sequence[tuple[int, int]]) -> str:
    """[(layer, head), ...] → `"L5H8,L0H9"` (in the given order; the `--disable` syntax)."""
    return ",".join(f"L{la}H{h}" for la, h in heads)


@contextmanager
def disabled(lens: LensLike, ablations: Sequence[Ablation] | str) -> Iterator[None]:
    """Disable heads in every `lens.trace`, `lens.analyze`, sweep or `hooked` call on this lens inside the
    context. `ablations`: `Ablation`s or a `parse_heads` string (mode zero: what physically pruning the heads
    does). Mode zero only: the traces record α^h = 0, so every decomposition of them stays exact (uniform needs
    each batch's mask, mean replaces z unseen by α: use `ablated_trace` / `merged_edits` for those)."""
    if isinstance(ablations, str):
        ablations = parse_heads(ablations, lens)
    if any(a.mode != "zero" for a in ablations):
        raise MixlensError("disabled() takes mode zero; for uniform or mean use ablated_trace or merged_edits")
    edits = merged_edits(lens, ablations, torch.ones(1, 1, dtype=torch.bool)) if ablations else {}
    with default_edits(lens.adapter, edits):
        yield
