"""Disabling heads and layers with our own hooks (transformers 5 removed `head_mask`; docs/DESIGN.md §3.8).

Modes, for the selected heads of one layer:

- `uniform` (Kovaleva et al. 2019): α^h_ij ← 1/|K_i| over the allowed keys K_i (non-pad keys; for causal
  decoders also j ≤ i). The head's context becomes the mean of its allowed value vectors.
- `zero`: the head's context z^h_i = Σ_j α^h_ij v^h_j ← 0 (its output through W_O vanishes; b_O stays).
- `mean`: z^h_i ← the mean context of that head over the real tokens of a reference dataset.

A whole layer is all of its heads. Edits go through the engine's hook points `blocks.{l}.attn.pattern`
[B, H, n, n] and `blocks.{l}.attn.z` [B, H, n, d_h].

`sweep` scores every single head and every whole layer on a task metric. Per batch it runs the model
once to cache the residual stream entering each layer, then, per layer l, ONE forward pass of layers ≥ l
only over H + 1 stacked copies of the batch (copy k ablates head k, the last copy the whole layer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mixlens.adapters import _get
from mixlens.errors import MixlensError
from mixlens.trace import Edit, Trace, _repeat_kv, hooked, run_traced

MODES = ("uniform", "zero", "mean")


@dataclass(frozen=True)
class Ablation:
    """Disable `heads` of `layer` (None = every head: the whole layer) with `mode`."""

    layer: int
    heads: tuple[int, ...] | None = None
    mode: str = "uniform"


def _check(lens, ablations: Sequence[Ablation], means: torch.Tensor | None) -> None:
    n_layers, n_heads = lens.adapter.n_layers, lens.adapter.n_heads
    for a in ablations:
        if a.mode not in MODES:
            raise MixlensError(f"unknown ablation mode '{a.mode}'; valid: {', '.join(MODES)}")
        if not 0 <= a.layer < n_layers:
            raise MixlensError(f"layer {a.layer} out of range (the model has {n_layers} layers, 0-based)")
        if a.heads is not None and any(not 0 <= h < n_heads for h in a.heads):
            raise MixlensError(f"head out of range in {list(a.heads)} (the model has {n_heads} heads, 0-based)")
        if a.mode == "mean" and means is None:
            raise MixlensError("mean ablation needs head means (see `head_means`)")


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
    lens,
    layer: int,
    groups: Sequence[tuple[int, ...] | None],
    mode: str,
    mask: torch.Tensor,
    means: torch.Tensor | None = None,
    name_layer: int | None = None,
) -> dict[str, Edit]:
    """Edits ablating, in copy k of a batch stacked len(groups) times, the heads groups[k] of `layer`.

    mask [B, n] (of ONE copy); means [L, H, d_h] for mode 'mean'; `name_layer` overrides the layer index
    in the hook name (used when only the layers from `layer` on are run).
    """
    sel = _selection(groups, lens.adapter.n_heads)
    name = layer if name_layer is None else name_layer
    if mode == "uniform":
        causal = lens.adapter.family.causal
        return {f"blocks.{name}.attn.pattern": _edit(sel, lambda t: _uniform(mask.to(t.device), t.shape[-1],
                                                                             causal))}
    if mode == "zero":
        return {f"blocks.{name}.attn.z": _edit(sel, lambda t: torch.zeros((), device=t.device))}
    if mode == "mean":
        assert means is not None  # [L, H, d_h], required for mode 'mean'
        mean = means[layer]
        return {f"blocks.{name}.attn.z": _edit(sel, lambda t: mean.to(t.device)[None, :, None, :])}
    raise MixlensError(f"unknown ablation mode '{mode}'; valid: {', '.join(MODES)}")


def merged_edits(lens, ablations: Sequence[Ablation], mask: torch.Tensor,
                 means: torch.Tensor | None = None) -> dict[str, Edit]:
    """Edits applying all `ablations` to one (unstacked) batch; several ablations of a layer compose."""
    _check(lens, ablations, means)
    edits: dict[str, Edit] = {}
    for a in ablations:
        for name, fn in edits_for(lens, a.layer, [a.heads], a.mode, mask, means).items():
            prev = edits.get(name)
            edits[name] = fn if prev is None else _composed(fn, prev)
    return edits


def _composed(f: Edit, g: Edit) -> Edit:
    """The edit f ∘ g."""
    return lambda t: f(g(t))


def ablated_trace(lens, enc, ablations: Sequence[Ablation], means: torch.Tensor | None = None) -> Trace:
    """`lens.trace` with the heads/layers of `ablations` disabled (the trace records the edited α)."""
    if not hasattr(enc, "inputs"):
        enc = lens.encode(enc)
    return lens.trace(enc, edits=merged_edits(lens, ablations, enc.inputs["attention_mask"].bool(), means))


def head_contexts(trace: Trace) -> torch.Tensor:
    """z^h_i = Σ_j α^h_ij v^h_j of every layer (before W_O): [B, L, H, n, d_h]."""
    return torch.stack([torch.matmul(lt.alpha, _repeat_kv(lt.value, lt.alpha.shape[1])) for lt in trace.layers], 1)


@torch.no_grad()
def head_means(lens, texts: Sequence, batch_size: int = 32, max_length: int | None = None) -> torch.Tensor:
    """Mean head context over the real tokens of `texts` (the reference for mode 'mean'): [L, H, d_h]."""
    total, count = None, 0
    for start in range(0, len(texts), batch_size):
        tr = lens.trace(lens.encode(texts[start : start + batch_size], max_length))
        m = tr.mask[:, None, None, :, None].float()
        s = (head_contexts(tr).float() * m).sum((0, 3))
        total = s if total is None else total + s
        count += int(tr.mask.sum())
    if total is None:
        raise MixlensError("no input text given")
    return total / count


# ------------------------------------------------------------------------------------------------ sweep


def _batch_mean_contexts(trace: Trace) -> tuple[torch.Tensor, int]:
    m = trace.mask[:, None, None, :, None].float()
    return (head_contexts(trace).float() * m).sum((0, 3)), int(trace.mask.sum())


@contextmanager
def _from_layer(lens, layer: int, x: torch.Tensor | None) -> Iterator[None]:
    """Run only layers ≥ `layer`, feeding them the cached residual stream x [B', n, d] (the embeddings are
    still computed, and discarded). The attention calls are then numbered from 0."""
    fam = lens.adapter.family
    if layer == 0:
        yield
        return
    parent_path, _, attr = fam.layers.rpartition(".")
    parent = _get(lens.adapter.base, parent_path) if parent_path else lens.adapter.base
    full = getattr(parent, attr)
    first = full[layer]

    def swap(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    handle = first.register_forward_pre_hook(swap, with_kwargs=True)
    setattr(parent, attr, nn.ModuleList(list(full)[layer:]))
    try:
        yield
    finally:
        setattr(parent, attr, full)
        handle.remove()


def _can_skip(lens) -> bool:
    """Layers can be skipped when the layer list is a plain ModuleList run in order (not ALBERT's groups)."""
    fam = lens.adapter.family
    if fam.name == "albert":
        return False
    mods = _get(lens.adapter.base, fam.layers)
    return isinstance(mods, nn.ModuleList) and len(mods) == lens.adapter.n_layers


def _repeat(inputs: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    return {key: v.repeat(k, *([1] * (v.dim() - 1))) for key, v in inputs.items()}


@dataclass
class SweepResult:
    """Task scores: `baseline` unablated, `heads` [L, H] with one head disabled, `layers` [L] with one whole
    layer disabled. `delta_*` = ablated − baseline."""

    metric: str
    higher_is_better: bool
    mode: str
    baseline: float
    heads: np.ndarray
    layers: np.ndarray
    n_examples: int

    @property
    def delta_heads(self) -> np.ndarray:
        return self.heads - self.baseline

    @property
    def delta_layers(self) -> np.ndarray:
        return self.layers - self.baseline

    def top_changes(self, k: int = 10) -> list[tuple[str, float]]:
        """The k ablations that hurt the metric most (by signed harm), as ('L{l}H{h}' or 'L{l}', delta)."""
        sign = -1.0 if self.higher_is_better else 1.0
        items = [(f"L{la}H{h}", float(self.delta_heads[la, h])) for la in range(self.heads.shape[0])
                 for h in range(self.heads.shape[1])]
        items += [(f"L{la}", float(d)) for la, d in enumerate(self.delta_layers)]
        return sorted(items, key=lambda it: -sign * it[1])[:k]


@torch.no_grad()
def sweep(lens, task, mode: str = "uniform", on_step: Callable[[int], None] | None = None) -> SweepResult:
    """Score every single head and every whole layer of `lens` ablated with `mode` on `task`
    (a `Task`: `StsTask`, `MlmTask` or `ClassificationTask`).

    `on_step(n)` is called after each forward pass (1 + L per batch, plus one per batch for mode 'mean').
    """
    if mode not in MODES:
        raise MixlensError(f"unknown ablation mode '{mode}'; valid: {', '.join(MODES)}")
    adapter = lens.adapter
    n_layers, n_heads = adapter.n_layers, adapter.n_heads
    groups: list[tuple[int, ...] | None] = [(h,) for h in range(n_heads)] + [None]
    k = len(groups)
    extra = {"use_cache": False} if adapter.family.causal else {}
    base_parts: list[Any] = []
    means: torch.Tensor | None = None
    total: torch.Tensor | None = None
    count = 0
    if mode == "mean":  # the reference contexts come from the same data, before any ablation
        for inputs in task.batches:
            s, c = _batch_mean_contexts(run_traced(adapter, lens.model, inputs))
            total, count = (s if total is None else total + s), count + c
            if on_step:
                on_step(1)
        assert total is not None
        means = total / count
    parts: list[list[list[torch.Tensor]]] = [[[] for _ in range(k)] for _ in range(n_layers)]
    skip = _can_skip(lens)
    for i, inputs in enumerate(task.batches):
        b = inputs["input_ids"].shape[0]
        with hooked(adapter) as rec:
            out = lens.model(**inputs, **extra)
        base_parts.append(task.collect(out, i))
        if on_step:
            on_step(1)
        mask = inputs["attention_mask"].bool()
        stacked = _repeat(inputs, k)
        for layer in range(n_layers):
            start = layer if skip else 0
            edits = edits_for(lens, layer, groups, mode, mask, means, name_layer=layer - start)
            x = rec["x"][layer].repeat(k, 1, 1) if skip else None
            with _from_layer(lens, start, x), hooked(adapter, edits):
                out = lens.model(**stacked, **extra)
            res = task.collect(out, i)
            for c in range(k):
                parts[layer][c].append(res[c * b : (c + 1) * b])
            if on_step:
                on_step(1)
    baseline = task.score(base_parts)
    scores = np.array([[task.score(parts[layer][c]) for c in range(k)] for layer in range(n_layers)])
    return SweepResult(task.metric, task.higher_is_better, mode, baseline, scores[:, :n_heads], scores[:, n_heads],
                       task.n_examples)


def sweep_steps(lens, task, mode: str) -> int:
    """Forward passes `sweep` will make (for progress bars)."""
    n = len(task.batches)
    return n * (1 + lens.adapter.n_layers) + (n if mode == "mean" else 0)


# ------------------------------------------------------------------------------------------------ tasks


class Task:
    """A metric over fixed, pre-tokenized batches (sorted by length). `collect(output, i)` turns the model
    output for batch i — possibly `copies` stacked copies of it — into per-example rows [copies·B, ...];
    `score(parts)` turns the rows of all batches (one copy each, in batch order) into the metric."""

    metric: str
    higher_is_better: bool
    batches: list[dict[str, torch.Tensor]]
    n_examples: int

    def collect(self, output, i: int) -> torch.Tensor:
        raise NotImplementedError

    def score(self, parts: list[torch.Tensor]) -> float:
        raise NotImplementedError


def _sorted_batches(lens, texts: Sequence, batch_size: int, max_length: int | None
                    ) -> tuple[list[dict[str, torch.Tensor]], np.ndarray]:
    """Batches of `texts` sorted by token length, and the text index of each row in batch order."""
    lengths = [len(ids) for ids in lens.tokenizer(list(texts), truncation=False)["input_ids"]]
    order = np.argsort(lengths, kind="stable")
    batches = [lens.encode([texts[j] for j in order[s : s + batch_size]], max_length).inputs
               for s in range(0, len(order), max(1, batch_size))]
    return batches, order


class StsTask(Task):
    """Spearman ρ between the cosine similarity of mean-pooled sentence embeddings (mean over real tokens
    of the last hidden state, the sentence-transformers pooling of all-MiniLM-L6-v2) and gold scores."""

    metric, higher_is_better = "spearman", True

    def __init__(self, lens, pairs: Sequence[tuple[str, str]], gold: Sequence[float], batch_size: int = 64,
                 max_length: int | None = None):
        if len(pairs) != len(gold) or not pairs:
            raise MixlensError("the STS task needs one gold score per sentence pair (and at least one pair)")
        flat = [s for p in pairs for s in p]
        self.batches, self.order = _sorted_batches(lens, flat, batch_size, max_length)
        self.gold = np.asarray(gold, dtype=float)
        self.n_examples = len(pairs)

    def collect(self, output, i: int) -> torch.Tensor:
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None:
            raise MixlensError("the STS metric needs a base encoder (load the model with head 'base')")
        mask = self.batches[i]["attention_mask"]
        m = mask.repeat(hidden.shape[0] // mask.shape[0], 1)[..., None].float()
        return (hidden * m).sum(1) / m.sum(1).clamp_min(1)

    def score(self, parts: list[torch.Tensor]) -> float:
        from scipy.stats import spearmanr

        emb = torch.empty(len(self.order), parts[0].shape[-1])
        emb[torch.as_tensor(self.order)] = torch.cat(parts).float().cpu()
        cos = torch.nn.functional.cosine_similarity(emb[0::2], emb[1::2], dim=-1).numpy()
        return float(spearmanr(cos, self.gold).statistic)


class MlmTask(Task):
    """Mean cross-entropy of a masked LM on masked tokens: a fixed random `rate` of the real non-special
    tokens of each text (at least one) replaced by the mask token (seeded, so every ablation sees the same)."""

    metric, higher_is_better = "mlm_loss", False

    def __init__(self, lens, texts: Sequence[str], batch_size: int = 32, max_length: int | None = None,
                 rate: float = 0.15, seed: int = 0):
        tok = lens.tokenizer
        if tok.mask_token_id is None:
            raise MixlensError("the MLM metric needs a tokenizer with a mask token")
        self.batches, _ = _sorted_batches(lens, list(texts), batch_size, max_length)
        gen = torch.Generator().manual_seed(seed)
        self.labels = []
        for inputs in self.batches:
            ids = inputs["input_ids"]
            roles = torch.tensor([[r is None for r in lens.special_roles(row.tolist())] for row in ids])
            ok = roles & inputs["attention_mask"].bool().cpu()
            pick = (torch.rand(ids.shape, generator=gen) < rate) & ok
            first = ok.float().argmax(1)  # every text keeps at least one masked token
            pick[torch.arange(len(ids)), first] |= ok.any(1)
            self.labels.append(torch.where(pick, ids.cpu(), torch.full_like(ids.cpu(), -100)))
            inputs["input_ids"] = torch.where(pick.to(ids.device), tok.mask_token_id, ids)
        self.n_examples = len(texts)

    def collect(self, output, i: int) -> torch.Tensor:
        logits = getattr(output, "logits", None)
        if logits is None or logits.dim() != 3:
            raise MixlensError("the MLM metric needs a masked-LM head (load the model with head 'masked-lm')")
        labels = self.labels[i].repeat(logits.shape[0] // self.labels[i].shape[0], 1).to(logits.device)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), labels, ignore_index=-100,
                                               reduction="none")
        return torch.stack([ce.sum(1), (labels != -100).sum(1).float()], -1)

    def score(self, parts: list[torch.Tensor]) -> float:
        s = torch.cat(parts).sum(0)
        return float(s[0] / s[1])


class ClassificationTask(Task):
    """Accuracy of a sequence classifier against integer labels."""

    metric, higher_is_better = "accuracy", True

    def __init__(self, lens, texts: Sequence, labels: Sequence[int], batch_size: int = 32,
                 max_length: int | None = None):
        if len(texts) != len(labels) or not texts:
            raise MixlensError("the accuracy metric needs one label per text (and at least one text)")
        self.batches, order = _sorted_batches(lens, list(texts), batch_size, max_length)
        lab = torch.as_tensor(np.asarray(labels)[order], dtype=torch.long)
        sizes = [b["input_ids"].shape[0] for b in self.batches]
        self.labels = list(torch.split(lab, sizes))
        self.n_examples = len(texts)

    def collect(self, output, i: int) -> torch.Tensor:
        logits = getattr(output, "logits", None)
        if logits is None or logits.dim() != 2:
            raise MixlensError("the accuracy metric needs a sequence-classification head")
        labels = self.labels[i].repeat(logits.shape[0] // self.labels[i].shape[0]).to(logits.device)
        return (logits.argmax(-1) == labels).float()

    def score(self, parts: list[torch.Tensor]) -> float:
        return float(torch.cat(parts).mean())
