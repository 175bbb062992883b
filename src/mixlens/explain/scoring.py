"""The scoring passes of `evaluate`: which tokens a removal takes away (`top_k`, `perturb`) and f of every
perturbed input, de-duplicated and batched by length (`perturbed_f`).

Removal 'delete' drops the tokens from the input ids, 'mask' replaces them with the mask token, 'none' runs no
perturbed pass. f(x) is the target's probability (classifiers, causal LMs), the cosine of the pooled embedding to
the unperturbed one (encoders), or with a foil (contrastive tasks) the logit difference target − foil.
"""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch

from mixlens.explain.context import sdpa
from mixlens.explain.evaluation import KS, LEVELS, NO_REMOVAL, Example
from mixlens.memory import release
from mixlens.methods.saliency import keeps_logits
from mixlens.pipeline import plan_batches
from mixlens.targets import score

FORWARD_TOKENS = 4096  # tokens per forward pass of perturbed inputs (a layer's transients: ~44 KB a token, SmolLM2)
FORWARD_CELLS = 1 << 23  # and token pairs (inputs · n²): an eager layer's [B, H, n, n] attention stays bounded


def top_k(score: np.ndarray, special: np.ndarray, pct: float) -> np.ndarray:
    """Positions of the top-`pct` % non-special tokens by score (ties: earlier position first), ⌈pct·m/100⌉ of them."""
    cand = np.flatnonzero(~special)
    k = math.ceil(pct * len(cand) / 100 - 1e-9)
    order = np.lexsort((cand, -score[cand]))  # primary key: score descending; then position ascending
    return np.sort(cand[order[:k]])


def perturb(
    ids: list[int], chosen: np.ndarray, special: np.ndarray, keep: bool, removal: str, mask_id: int | None
) -> tuple[int, ...]:
    """Remove the `chosen` positions (keep=False) or every non-special position but them (keep=True)."""
    hit = np.zeros(len(ids), dtype=bool)
    hit[chosen] = True
    drop = (~hit & ~special) if keep else hit
    if removal == "delete":
        return tuple(t for t, d in zip(ids, drop, strict=True) if not d)
    assert mask_id is not None  # removal "mask" needs a mask token (checked by evaluate)
    return tuple(mask_id if d else t for t, d in zip(ids, drop, strict=True))


def special_mask(lens, ids: list[int]) -> np.ndarray:
    return np.array([r is not None and r != "unk" for r in lens.special_roles(ids)], dtype=bool)


def last_token_f(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], index: torch.Tensor, foil: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal LMs: the target token's probability (with `foil` [B]: the logit difference target − foil) at each
    row's last real token, unembedding only the distinct last positions of the batch (sorted by length, so few)
    instead of all n: [B]."""
    last = inputs["attention_mask"].sum(-1) - 1  # [B]
    keep, where = torch.unique(last, return_inverse=True)
    logits = model(**inputs, logits_to_keep=keep).logits  # [B, len(keep), V]
    rows = logits[torch.arange(last.shape[0], device=last.device), where].float()  # [B, V]
    if foil is not None:
        idx = torch.stack([index, foil], 1).to(rows.device)
        pair = rows.gather(1, idx)
        return pair[:, 0] - pair[:, 1]
    return rows.softmax(-1).gather(1, index.to(rows.device)[:, None])[:, 0]


def fused(model: torch.nn.Module, kind: str) -> contextlib.AbstractContextManager[None]:
    """The perturbed forwards of a causal LM run in torch's fused attention (`context.sdpa`: no [B, H, n, n] per
    layer, so a long input's passes take O(n) memory, not O(n²)) where its attention has no logit soft-cap (which the
    fused kernels lack) and the model supports them; other models run as loaded."""
    plain = getattr(model.config, "attn_logit_softcapping", None) is None and getattr(model, "_supports_sdpa", False)
    return sdpa(model) if kind == "causal" and plain else contextlib.nullcontext()


def forward_f(
    lens,
    kind: str,
    pool: str,
    seqs: list[tuple[int, ...]],
    owners: list[int],
    index: torch.Tensor,
    e0: torch.Tensor,
    foil: torch.Tensor | None = None,
) -> np.ndarray:
    """f of every perturbed sequence (owner = its example's row in index / e0 / foil), batched by length; with
    `foil` (a contrastive task) the logit difference target − foil. A sequence emptied by removal (models without
    special tokens) is read as the single BOS (else EOS, else CLS) token."""
    tok = lens.tokenizer
    start_id = next((t for t in (tok.bos_token_id, tok.eos_token_id, tok.cls_token_id) if t is not None), None)
    seqs = [s if s or start_id is None else (start_id,) for s in seqs]
    out = np.zeros(len(seqs))
    with fused(lens.model, kind), torch.no_grad():
        for rows in plan_batches([len(x) for x in seqs], len(seqs), FORWARD_TOKENS, FORWARD_CELLS):  # by length
            inputs = lens.encode_ids([seqs[i] for i in rows]).inputs
            own = torch.tensor([owners[i] for i in rows])
            if kind == "causal" and keeps_logits(lens.model):
                f = last_token_f(lens.model, inputs, index[own], None if foil is None else foil[own])
            else:
                res = lens.model(**inputs)
                mask = inputs["attention_mask"]
                last = mask.sum(-1).cpu() - 1 if kind == "causal" else torch.zeros(len(rows), dtype=torch.long)
                fo = torch.full((len(rows),), -1) if foil is None else foil[own]
                g, f = score(kind, pool, res, mask, index[own], fo, last, e0[own])
                f = f if foil is None else g
            out[rows] = f.float().cpu().numpy()
            release(max(len(seqs[i]) for i in rows))  # a long chunk's freed activations back to the system
    return out


def perturbed_f(
    lens,
    ro,
    e0: torch.Tensor,
    batch: list[Example],
    methods: list[str],
    removal: str,
    mask_id: int | None,
    timings: dict[str, float],
) -> None:
    """Fill each example's `removed` and `kept` f values: every perturbed input of the batch de-duplicated and run
    together, sorted by length (removal 'none': nothing to run, they stay empty)."""
    if removal == NO_REMOVAL:
        return
    seqs: dict[tuple[tuple[int, ...], int], int] = {}  # (sequence, example) → row
    plan = []
    for b, e in enumerate(batch):
        for m in methods:
            for keep, levels in ((False, LEVELS), (True, KS)):
                for k in levels:
                    s = perturb(e.ids, top_k(e.scores[m], e.special, k), e.special, keep, removal, mask_id)
                    plan.append((b, m, keep, k, seqs.setdefault((s, b), len(seqs))))
    t0 = time.perf_counter()
    keys = list(seqs)
    contrast = batch[0].contrast is not None
    owners = [b for _, b in keys]
    fs = forward_f(lens, ro.kind, ro.pool, [s for s, _ in keys], owners, ro.index, e0, ro.foil if contrast else None)
    timings["forward"] += time.perf_counter() - t0
    for e in batch:
        e.removed = {m: np.zeros(len(LEVELS)) for m in methods}
        e.kept = {m: np.zeros(len(KS)) for m in methods}
    for b, m, keep, k, row in plan:
        if keep:
            batch[b].kept[m][KS.index(k)] = fs[row]
        else:
            batch[b].removed[m][LEVELS.index(k)] = fs[row]
