"""Unknown model types, tried safely (docs/guides/your-model.md, "Families").

A `model_type` outside the family table (`mixlens.adapters.FAMILIES`) is read under each known layout whose module
paths its layers have, in table order. A probe forward pass then rebuilds every piece of every layer from what the
layout says — the value projection, the attention output, the attention residual sum, the norm after it and the FFN
block — and compares it with what the model computed token by token, each token's error relative to that token's own
size (the engine's per-row check, `norms.row_error`, and for the attention output its `attn_row_size`). The first
layout under which every piece matches (the engine's tolerances for the model's dtype: `attn_tolerance` for the
attention output, `tolerance` for the others) is used, and the caller says which. If none matches, one line names the
closest layout and the first layer and piece that failed. A family forced by name (`--family`, `load(family=...)`) is
probed the same way. Every method still runs its own reconstruction check on every input afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixlens.adapters import FAMILIES, Adapter, Family, family_named, get_path, known_family, resolve
from mixlens.errors import MixlensError
from mixlens.methods.engine import TOLERANCE, attn_row_size, attn_tolerance, row_error, run_dtype, tolerance
from mixlens.trace import repeat_kv, run_traced

PROBE = "The quick brown fox jumps over the lazy dog, and then it quietly runs away from the river."
PIECES = ("module tree", "value projection", "attention output", "attention residual sum", "norm after the sum", "FFN")


@dataclass(frozen=True)
class Miss:
    """Where a layout first failed on a model: its family, the layer, the piece (`PIECES`) and what differed."""

    family: str
    layer: int
    piece: str
    detail: str
    error: float = float("inf")

    @property
    def progress(self) -> tuple[int, int, float]:
        """How far the layout got (later layer and piece, then smaller error: closer)."""
        return (self.layer, PIECES.index(self.piece), -self.error)

    def words(self) -> str:
        return f"{self.family} (layer {self.layer}, {self.piece}: {self.detail})"


def _paths(fam: Family) -> list[str]:
    """The module paths a family's layer must have."""
    named = (fam.attn, fam.v_proj, fam.o_proj, fam.ln_mix, fam.ffn_in, fam.ffn_out)
    optional = (fam.ln_in, fam.ln_out, fam.ffn_gate, fam.ln_post, fam.probs)
    return [p for p in (*named, *optional) if p]


def _tree_miss(fam: Family, model: Any) -> Miss | None:
    """The first module path of the family that the model lacks (the layer list, then each layer's pieces)."""
    try:
        layers = list(get_path(model.base_model, fam.layers))
    except (AttributeError, IndexError, TypeError):
        return Miss(fam.name, 0, "module tree", f"no layer list '{fam.layers}'", float(len(_paths(fam)) + 1))
    if not layers:
        return Miss(fam.name, 0, "module tree", f"'{fam.layers}' is empty")
    missing = []
    for path in _paths(fam):
        try:
            get_path(layers[0], path)
        except (AttributeError, IndexError, TypeError):
            missing.append(path)
    if missing:
        return Miss(fam.name, 0, "module tree", f"no module '{missing[0]}'", float(len(missing)))
    return None


def _hybrid(model: Any) -> str | None:
    """Where some layers of the model's layer list mix tokens without attention (a convolution or state-space block
    beside attention layers, e.g. LFM2): what they have instead, in words; None otherwise."""
    for path in dict.fromkeys(fam.layers for fam in FAMILIES):
        try:
            layers = list(get_path(model.base_model, path))
        except (AttributeError, IndexError, TypeError):
            continue
        children = [dict(layer.named_children()) for layer in layers]
        attends = [any("attn" in k.lower() or "attention" in k.lower() for k in c) for c in children]
        if any(attends) and not all(attends):
            without = [i for i, a in enumerate(attends) if not a]
            shared = set.intersection(*(set(c) for c, a in zip(children, attends, strict=True) if a))
            instead = sorted(set(children[without[0]]) - shared)
            shown = ", ".join(map(str, without[:8])) + (" ..." if len(without) > 8 else "")
            return (
                f"layers {shown} mix tokens without attention (through '{', '.join(instead)}' instead), so they have "
                "no attention weights to decompose"
            )
    return None


def _rel(rebuilt: torch.Tensor, real: torch.Tensor, size: torch.Tensor | None = None) -> float:
    """The largest error of a token's row relative to that row's size (`row_error`; rows: the last axis)."""
    return float(row_error(rebuilt, real, size).max())


def probe(adapter: Adapter, model: Any, tokenizer: Any) -> Miss | None:
    """Rebuild every piece of every layer of one probe forward pass from the adapter's reading; the first piece that
    differs from the model's own value past the engine's tolerance (None: the layout reads the model exactly)."""
    name = adapter.family.name
    device = next(model.parameters()).device
    enc = tokenizer(PROBE, return_tensors="pt")
    inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
    try:
        with torch.no_grad():
            tr = run_traced(adapter, model, inputs, ffn="update")
    except (RuntimeError, AttributeError, TypeError, ValueError, KeyError, MixlensError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        return Miss(name, 0, "value projection", f"the traced forward pass failed: {first}")
    limits = (tolerance(model, TOLERANCE), attn_tolerance(model))
    for k, (lt, lay) in enumerate(zip(tr.layers, adapter.layers, strict=True)):
        miss = _layer_miss(adapter, k, lt, lay, limits, run_dtype(model))
        if miss is not None:
            return miss
    return None


def _layer_miss(
    adapter: Adapter, k: int, lt: Any, lay: Any, limits: tuple[float, float], dtype: torch.dtype
) -> Miss | None:
    """The first piece of layer k whose rebuilt value differs from the model's own (in `PIECES` order): per token,
    relative to the token's row (`limits`: the tolerance of every piece, and of the attention output, whose size is
    the engine's `attn_row_size`)."""
    limit, attn_limit = limits
    pieces = (  # (piece, rebuilt, real [..., token, row], tolerance)
        ("value projection", lambda: _token_rows(_values(lt, lay)), _token_rows(lt.value), limit),
        ("attention output", lambda: _attention(lt, lay), lt.attn_out, attn_limit),
        ("attention residual sum", lambda: lt.x.float() + lt.attn_out.float(), lt.mix_in, limit),
        ("norm after the sum", lambda: _linear_norm(lay.ln_mix, lt.mix_in), lt.mix_out, limit),
        ("FFN", lambda: _ffn_block(adapter, lt, lay), lt.out, limit),
    )
    attn_size = attn_row_size(lt.attn_out, lay.b_o, lt.mix_in, dtype)
    name = adapter.family.name
    for piece, rebuild, real, limit in pieces:
        try:
            with torch.no_grad():
                rebuilt = rebuild()
        except (RuntimeError, AttributeError, TypeError, ValueError) as e:  # a module that is not what it claims
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            return Miss(name, k, piece, f"cannot be rebuilt: {first}")
        if rebuilt.shape != real.shape:
            return Miss(name, k, piece, f"shape {tuple(rebuilt.shape)} where the model has {tuple(real.shape)}")
        err = _rel(rebuilt, real, attn_size if piece == "attention output" else None)
        if not err <= limit:  # NaN fails too
            return Miss(name, k, piece, f"differs by {err:.3g} (relative; tolerance {limit:.3g})", err)
    return None


def _values(lt: Any, lay: Any) -> torch.Tensor:
    """v = LN_in(x) W_V + b_V (pre-LN; x itself without a norm before the attention) → [B, H_kv, n, d_h]."""
    if lay.ln_in is not None:
        weight = next(lay.ln_in.module.parameters(), None)  # the norm runs in its own dtype (bfloat16 models)
        src = lay.ln_in.module(lt.x if weight is None else lt.x.to(weight.dtype)).float()
    else:
        src = lt.x.float()
    v = src @ lay.w_v.float() + (lay.b_v.float() if lay.b_v is not None else 0)  # [B, n, H_kv·d_h]
    return v.unflatten(-1, (lay.n_kv_heads, lay.d_head)).transpose(1, 2)


def _token_rows(v: torch.Tensor) -> torch.Tensor:
    """Value vectors [B, H_kv, n, d_h] as one row per token [B, n, H_kv·d_h]."""
    return v.transpose(1, 2).flatten(2)


def _attention(lt: Any, lay: Any) -> torch.Tensor:
    """Σ_j Σ_h α^h_ij v^h_j W_O^h + b_O (α / s^post with a norm on the attention output) → [B, n, d]."""
    z = torch.matmul(lt.alpha_mix.float(), repeat_kv(lt.value.float(), lay.n_heads))  # [B, H, n, d_h]
    return z.transpose(1, 2).flatten(2) @ lay.w_o.float() + (lay.b_o.float() if lay.b_o is not None else 0)


def _linear_norm(norm: Any, y: torch.Tensor) -> torch.Tensor:
    """The norm through its linear form of docs/DESIGN.md §3.3: γ ⊙ C(y) / s + β."""
    y = y.float()
    return norm.project(y) / norm.scale(y)[..., None] + norm.shift()


def _ffn_block(adapter: Adapter, lt: Any, lay: Any) -> torch.Tensor:
    """The layer output rebuilt from the attention block's output and the FFN's: pre-LN x + ... + F (Gemma, OLMo 2:
    F after the post-FFN norm), post-LN LN2(LN1 output + F) through LN2's linear form."""
    f = lt.ffn_update
    if adapter.family.pre_ln:
        if lay.ln_post is not None:
            post = getattr(lay.module, "post_feedforward_layernorm", None)
            if post is None:
                return torch.full_like(lt.mix_in, float("nan"))
            f = post(f.to(next(post.parameters()).dtype))
        return lt.mix_in.float() + f.float()
    assert lay.ln_out is not None  # every post-LN family names its LN2
    return _linear_norm(lay.ln_out, lt.mix_out.float() + f.float())


def _tried(fam: Family, model: Any, tokenizer: Any) -> tuple[Adapter | None, Miss | None]:
    """The adapter of `fam` on the model when its probe passes, else where it failed."""
    miss = _tree_miss(fam, model)
    if miss is not None:
        return None, miss
    try:
        adapter = resolve(model, fam)
    except (AttributeError, IndexError, TypeError, ValueError, RuntimeError, MixlensError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        return None, Miss(fam.name, 0, "module tree", f"cannot read it: {first}")
    miss = probe(adapter, model, tokenizer)
    return (adapter, None) if miss is None else (None, miss)


def adapt(model: Any, tokenizer: Any, family: str | None = None) -> tuple[Adapter, str | None]:
    """(adapter, note): the model's own family from the table (no probe), a forced family (probed; one line if it
    does not fit), or for a model type outside the table the first known layout that passes the probe, with a note
    saying which. One line naming the closest layout and the first layer and piece that failed when none does."""
    model_type = model.config.model_type
    if family is not None:
        adapter, miss = _tried(family_named(family), model, tokenizer)
        if miss is not None:
            raise MixlensError(
                f"family '{family}' does not fit this '{model_type}' model: layer {miss.layer}, {miss.piece}: "
                f"{miss.detail}"
            )
        assert adapter is not None
        own = known_family(model_type)
        note = None if own is not None and own.name == family else f"read as the {family} layout (--family)"
        return adapter, note
    if known_family(model_type) is not None:
        return resolve(model), None
    hybrid = _hybrid(model)
    if hybrid is not None:
        raise MixlensError(f"model type '{model_type}' is a hybrid layout mixlens cannot decompose: {hybrid}")
    misses = []
    for fam in FAMILIES:
        adapter, miss = _tried(fam, model, tokenizer)
        if adapter is not None:
            return adapter, (
                f"model type '{model_type}' is not in the family table; read as the {fam.name} layout, whose "
                "reconstruction check passed on a probe input (--family forces a layout)"
            )
        assert miss is not None
        misses.append(miss)
    closest = max(misses, key=lambda m: m.progress if m.piece != "module tree" else (-1, 0, -m.error))
    raise MixlensError(
        f"model type '{model_type}' is not in the family table and no known layout reads it exactly; closest: "
        f"{closest.words()} (mixlens families lists the layouts)"
    )
