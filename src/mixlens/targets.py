"""Prediction targets: what an explanation explains, one notion for every method.

- sequence classifiers: a class (default: the predicted one; an index or a label name of `config.id2label`);
- causal LMs: the next token after the text (default: the model's top token; or a given token), optionally
  contrasted with a foil token: logit(target) − logit(foil);
- sentence encoders (base models, pooled as their sentence-transformers config says, mean by default): the
  pooled embedding e(x).

Two scalars per target, both functions of one model output:
- the *attribution score* g(x) that attribution methods explain: the target logit (minus the foil logit), or for
  encoders the projection e(x)·e₀/‖e₀‖² on the unperturbed embedding e₀ (the cosine's gradient vanishes at x,
  its maximum);
- the *faithfulness score* f(x) of `mixlens evaluate`: the target's probability (softmax over classes or over the
  vocabulary at the last real token), or for encoders cos(e(x), e₀).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mixlens.errors import MixlensError

KINDS = ("classifier", "causal", "encoder")


@dataclass(frozen=True)
class Target:
    """One input's target: kind 'class', 'token' or 'embedding'; index = class index or token id (−1 for an
    embedding); foil = contrast class/token id or None; label = human-readable name."""

    kind: str
    index: int
    label: str
    foil: int | None = None
    foil_label: str | None = None

    def to_json(self, score: float) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind, "label": self.label, "score": score}
        if self.foil is not None:
            out["foil"] = self.foil_label
        return out


def model_kind(model: torch.nn.Module) -> str:
    """'classifier', 'causal' or 'encoder' from the model's head class."""
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        return "classifier"
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal"
    if name.endswith("Model"):
        return "encoder"
    raise MixlensError(
        f"explain supports sequence classifiers, causal LMs and base encoders, not {name}; "
        "load the model with head='sequence-classification', 'causal-lm' or 'base'"
    )


def pooling(model: torch.nn.Module) -> str:
    """'cls' or 'mean': the sentence-transformers pooling of a base encoder (mean when not configured)."""
    cfg = Path(str(getattr(model.config, "_name_or_path", ""))) / "1_Pooling" / "config.json"
    if cfg.is_file():
        modes = json.loads(cfg.read_text())
        if modes.get("pooling_mode_cls_token") and not modes.get("pooling_mode_mean_tokens"):
            return "cls"
    return "mean"


@dataclass
class Readout:
    """Reads g (attribution score) and f (faithfulness score) from a model output, for a batch of targets.

    index [B] class/token ids, foil [B] (−1: none), e0 [B, d] unperturbed pooled embeddings (encoders)."""

    kind: str
    pool: str
    index: torch.Tensor
    foil: torch.Tensor
    e0: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Per-input tensors that travel with captum's batch expansion (see `scores`)."""
        e0 = self.e0 if self.e0 is not None else torch.zeros(self.index.shape[0], 1)
        return self.index, self.foil, e0

    def select(self, rows: slice | torch.Tensor) -> Readout:
        e0 = self.e0[rows] if self.e0 is not None else None
        return Readout(self.kind, self.pool, self.index[rows], self.foil[rows], e0)


def pooled(hidden: torch.Tensor, mask: torch.Tensor, pool: str) -> torch.Tensor:
    """hidden [B, n, d], mask [B, n] → [B, d] (mean over real tokens, or the first token)."""
    if pool == "cls":
        return hidden[:, 0]
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1)


def head_rows(kind: str, out, mask: torch.Tensor) -> torch.Tensor:
    """Classifier logits [B, C], or the causal LM's logits at the last real token [B, V]."""
    if kind == "classifier":
        return out.logits
    last = mask.long().sum(-1) - 1
    return out.logits[torch.arange(last.shape[0], device=last.device), last]


def scores(
    kind: str, pool: str, out, mask: torch.Tensor, index: torch.Tensor, foil: torch.Tensor, e0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [B], f [B]) of one model output; see the module docstring."""
    if kind == "encoder":
        e = pooled(out.last_hidden_state, mask, pool)
        g = (e * e0).sum(-1) / (e0 * e0).sum(-1).clamp_min(torch.finfo(e0.dtype).tiny)
        return g, F.cosine_similarity(e, e0, dim=-1)
    rows = head_rows(kind, out, mask)
    idx = index.to(rows.device)[:, None]
    g = rows.gather(1, idx)[:, 0]
    has_foil = foil.to(rows.device) >= 0
    g = g - torch.where(has_foil, rows.gather(1, foil.clamp_min(0).to(rows.device)[:, None])[:, 0], 0.0)
    return g, rows.softmax(-1).gather(1, idx)[:, 0]


def _class_index(config, spec: str | int) -> int:
    labels = {int(k): str(v) for k, v in (config.id2label or {}).items()}
    n = config.num_labels
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().lstrip("-").isdigit()):
        i = int(spec)
        if not 0 <= i < n:
            raise MixlensError(f"class {i} out of range; the model has {n} classes")
        return i
    for i, name in labels.items():
        if name.lower() == str(spec).strip().lower():
            return i
    raise MixlensError(f"the model has no label '{spec}'; labels: {', '.join(labels[i] for i in sorted(labels))}")


def token_id(tokenizer, spec: str | int) -> int:
    """A single vocabulary token from an id, a vocabulary entry, or a text that tokenizes to one token."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        if not 0 <= spec < len(tokenizer):
            raise MixlensError(f"token id {spec} out of range; the vocabulary has {len(tokenizer)} entries")
        return spec
    vocab = tokenizer.get_vocab()
    if spec in vocab:
        return vocab[spec]
    ids = tokenizer(spec, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise MixlensError(f"'{spec}' is {len(ids)} tokens for this tokenizer; give a single token")
    return ids[0]


def token_label(tokenizer, tid: int) -> str:
    return tokenizer.convert_ids_to_tokens(int(tid))


def resolve(
    lens, inputs: dict[str, torch.Tensor], target: str | int | None = None, foil: str | int | None = None
) -> tuple[list[Target], Readout, torch.Tensor]:
    """Targets of a batch (one unperturbed forward pass) → (targets, readout, f(x) [B] or the contrast g(x))."""
    model, kind = lens.model, model_kind(lens.model)
    mask = inputs["attention_mask"]
    with torch.no_grad():
        out = model(**inputs)
    bsz = mask.shape[0]
    if kind == "encoder":
        if target is not None or foil is not None:
            raise MixlensError("a sentence encoder has one target, its pooled embedding: drop --target/--foil")
        pool = pooling(model)
        e0 = pooled(out.last_hidden_state, mask, pool)
        idx = torch.full((bsz,), -1)
        ro = Readout(kind, pool, idx, idx.clone(), e0)
        return [Target("embedding", -1, f"{pool}-pooled embedding") for _ in range(bsz)], ro, torch.ones(bsz)
    rows = head_rows(kind, out, mask)
    if kind == "classifier":
        labels = {int(k): str(v) for k, v in (model.config.id2label or {}).items()}

        def resolve_one(spec: str | int) -> int:
            return _class_index(model.config, spec)

        def name(i: int) -> str:
            return labels.get(i, str(i))
    else:

        def resolve_one(spec: str | int) -> int:
            return token_id(lens.tokenizer, spec)

        def name(i: int) -> str:
            return token_label(lens.tokenizer, i)

    idx = rows.argmax(-1).cpu() if target is None else torch.full((bsz,), resolve_one(target))
    fo = torch.full((bsz,), -1) if foil is None else torch.full((bsz,), resolve_one(foil))
    if foil is not None and bool((fo == idx).any()):
        raise MixlensError(
            f"the foil '{foil}' is the target itself; a contrast needs two different "
            f"{'classes' if kind == 'classifier' else 'tokens'}"
        )
    ro = Readout(kind, "", idx, fo)
    g, f = scores(kind, "", out, mask, idx, fo, torch.zeros(bsz, 1))
    kind_name = "class" if kind == "classifier" else "token"
    targets = [
        Target(kind_name, int(i), name(int(i)), None if int(o) < 0 else int(o), None if int(o) < 0 else name(int(o)))
        for i, o in zip(idx, fo, strict=True)
    ]
    return targets, ro, (g if foil is not None else f).detach().cpu()
