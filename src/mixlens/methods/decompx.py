"""DecompX (Modarressi et al. 2023; docs/DESIGN.md §3.5): per-source vectors carried through the whole model.

Every hidden state is kept as a sum over source tokens k, x_i = Σ_k x_{i⇐k}, starting from x⁰_{i⇐k} = [i=k] x⁰_i
(the embedding output). Each operation is applied to every part:

- attention + residual: y_{i⇐k} = x_{i⇐k} + Σ_h Σ_j α^h_ij x_{j⇐k} W_V^h W_O^h (pre-LN: of the LN(x) parts);
- LayerNorm / RMSNorm: g_i(v) = γ ⊙ C(v) / s_i with s_i from the real input (linear per example);
- FFN: activation linearised per example, θ_i = act(z_i) / z_i from the real pre-activation z_i, applied
  elementwise to each part (gated FFNs: θ_i = act(gate_i), the up-projection parts are carried);
- pooler / classification head: the same linearisation (tanh, gelu, relu);
- every bias b (β, FFN and head biases, b_O, and b_V W_O; see below) is shared among the sources by AbsDot:
  part k receives |b·z_{i⇐k}| / Σ_k' |b·z_{i⇐k'}| of b (evenly when all dot products are 0).

The value bias follows `value_bias`: "values" (default; the official code, mohsenfayyaz/DecompX
src/modeling_bert.py) keeps it inside each token's value vector in the first layer, where every position holds
only its own token: part j of target i gets Σ_h α^h_ij (x_j W_V^h + b_V^h) W_O^h, and only b_O is shared; later
layers share b_V W_O + b_O. "absdot" shares b_V W_O + b_O in every layer.

So each class's token scores sum exactly to that class's logit; the relative error is checked on every input.
Position-wise steps run in chunks of target rows: one 256-token input peaks at ~1.1 GiB process RSS (bundled model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn
from transformers.activations import ACT2FN

from mixlens.adapters import Adapter, Layer, Norm, ffn_in_xw, ffn_out_xw, final_norm, final_proj, linear_xw
from mixlens.errors import MixlensError, ReconstructionError
from mixlens.methods.memo import memo_of
from mixlens.methods.registry import Card, Option, Planned, register, vector_dense
from mixlens.trace import LayerTrace, Trace

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("global.md", "DecompX: the reference and its conventions")

TOLERANCE = 1e-3  # max |Σ_k score − logit| / max |logit|
CHUNK_ELEMENTS = 1 << 24  # floats per position-wise working tensor (64 MB)

Act = Callable[[torch.Tensor], torch.Tensor] | None
ValueBias = Literal["values", "absdot"]  # where b_V goes (module docstring)
VALUE_BIAS: tuple[str, ...] = get_args(ValueBias)


@dataclass
class DecompXInput:
    """DecompX of one input (n real tokens, C classes, L layers, d hidden)."""

    classes: torch.Tensor  # [C, n(source)] signed token scores; Σ over sources = logits
    layers: torch.Tensor  # [L, n(target), n(source)] ‖x^l_{i⇐k}‖ of every layer output
    sums: torch.Tensor  # [L, n, d] Σ_k x^l_{i⇐k} (equals the real layer outputs)
    error: float  # max |Σ_k scores − logits| / max |logits| (relative)


def share(parts: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """parts [..., k, D] plus bias [D] shared over the k axis by AbsDot (see module docstring)."""
    if bias is None:
        return parts
    dots = (parts @ bias.float()).abs()  # [..., k]
    tot = dots.sum(-1, keepdim=True)
    w = torch.where(tot > 0, dots / torch.where(tot > 0, tot, torch.ones_like(tot)), 1.0 / parts.shape[-2])
    return parts + w[..., None] * bias.float()


def _apply_norm(parts: torch.Tensor, norm: Norm, real_in: torch.Tensor) -> torch.Tensor:
    """g_i on every part: parts [r, k, d], real_in [r, d] (the real norm input rows)."""
    s = norm.scale(real_in.float())[:, None, None]
    return share(norm.project(parts) / s, norm.bias)


def _linearised(parts: torch.Tensor, lin: nn.Module, act: Act) -> torch.Tensor:
    """A linear layer (bias shared) then, optionally, an activation linearised at the real pre-activation."""
    w, b = linear_xw(lin)
    out = share(parts @ w.float(), b)
    if act is None:
        return out
    z = out.sum(-2)  # [r, D] the real pre-activation
    theta = torch.where(z != 0, act(z) / torch.where(z != 0, z, torch.ones_like(z)), torch.zeros_like(z))
    return out * theta[:, None, :]


def _attention(parts: torch.Tensor, alpha: torch.Tensor, lay: Layer, own_bias: bool) -> torch.Tensor:
    """Σ_h Σ_j α^h_ij (v_{j⇐k}) W_O^h: parts [n, k, d], alpha [H, n, n] → [n, k, d] (b_O not included).

    v_{j⇐k} = parts_{j⇐k} W_V^h, plus b_V^h for k = j when `own_bias` (the first layer's parts are diagonal).
    """
    n, k, _ = parts.shape
    v = (parts @ lay.w_v.float()).view(n, k, lay.n_kv_heads, lay.d_head)
    if own_bias and lay.b_v is not None:
        idx = torch.arange(n)
        v[idx, idx] += lay.b_v.float().view(lay.n_kv_heads, lay.d_head)
    v = v.repeat_interleave(lay.n_heads // lay.n_kv_heads, dim=2)
    z = torch.einsum("hij,jkhe->ikhe", alpha, v).reshape(n, k, -1)
    return z @ lay.w_o.float()


def _attn_bias(lay: Layer, with_value: bool) -> torch.Tensor | None:
    """b_O, plus b_V W_O (the value bias's share of the output, as rows of α sum to 1) when `with_value`."""
    b = lay.b_o.float() if lay.b_o is not None else None
    if with_value and lay.b_v is not None:
        bv = lay.b_v.float().view(lay.n_kv_heads, lay.d_head).repeat_interleave(lay.n_heads // lay.n_kv_heads, 0)
        bvo = bv.reshape(-1) @ lay.w_o.float()
        b = bvo if b is None else b + bvo
    return b


def _rows(n: int, width: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(1, n * width))
    return [slice(s, min(n, s + step)) for s in range(0, n, step)]


def _ffn(parts: torch.Tensor, lt: LayerTrace, lay: Layer, b: int, n: int, rows: slice) -> torch.Tensor:
    """FFN output parts [r, k, d] for the target rows `rows` (parts = the FFN input parts of those rows)."""
    w_in, b_in = ffn_in_xw(lay)
    assert lt.ffn_pre is not None and lt.ffn_act is not None  # decompx traces with ffn=True
    pre, act = lt.ffn_pre[b, :n][rows].float(), lt.ffn_act[b, :n][rows].float()
    theta = torch.where(pre != 0, act / torch.where(pre != 0, pre, torch.ones_like(pre)), torch.zeros_like(pre))
    h = share(parts @ w_in.float(), b_in) * theta[:, None, :]
    w_out, b_out = ffn_out_xw(lay)
    return share(h @ w_out.float(), b_out)


def _layer(x: torch.Tensor, lt: LayerTrace, lay: Layer, pre_ln: bool, b: int, own_bias: bool) -> torch.Tensor:
    """One layer on the parts x [n(target), n(source), d] of input b → the parts of the layer output.

    `own_bias`: b_V stays in each token's value vector (first layer, value_bias="values"), else it is shared.
    """
    n, _, d = x.shape
    alpha = lt.alpha[b, :, :n, :n].float()
    if pre_ln and lay.ln_in is not None:  # (ModernBERT's first layer has no attention norm)
        ln_x = torch.cat([_apply_norm(x[r], lay.ln_in, lt.x[b, :n][r]) for r in _rows(n, d)])
        y = x + _attention(ln_x, alpha, lay, own_bias)
        del ln_x
    else:
        y = x + _attention(x, alpha, lay, own_bias)
    b_att = _attn_bias(lay, not own_bias)
    assert lt.ffn_pre is not None
    d_ff = lt.ffn_pre.shape[-1]
    out = torch.empty_like(y)
    for r in _rows(n, max(d, d_ff)):
        yr = share(y[r], b_att)  # Σ_k = the real norm input (mix_in)
        if lay.ln_ffn is not None:  # a parallel block: the FFN reads ln_ffn(x) of the layer input
            zr = _apply_norm(x[r], lay.ln_ffn, lt.x[b, :n][r])
        else:
            zr = _apply_norm(yr, lay.ln_mix, lt.mix_in[b, :n][r])  # Σ_k = mix_out
        fr = _ffn(zr, lt, lay, b, n, r)
        if pre_ln:
            out[r] = yr + fr
        else:
            assert lay.ln_out is not None and lt.ln_out_in is not None
            out[r] = _apply_norm(zr + fr, lay.ln_out, lt.ln_out_in[b, :n][r])
    return out


Step = tuple[nn.Module, Act] | Norm  # a linear layer with its (linearised) activation, or a norm
Pool = Literal["first", "last", "mean"]  # the position(s) the head reads: [CLS], the last token, the real tokens' mean


def _head(model: Any, adapter: Adapter) -> tuple[list[Step], Norm | None, Pool]:
    """(the head's steps, the final norm before the head, the pooling)."""
    family = adapter.family.name
    name = type(model).__name__
    if not name.endswith("ForSequenceClassification"):
        raise MixlensError(
            f"decompx needs a sequence-classification model, got {name}; load it with "
            "head='sequence-classification' (CLI: --head sequence-classification)"
        )
    if family == "bert":
        pooler = model.bert.pooler
        return [(pooler.dense, torch.tanh), (model.classifier, None)], None, "first"
    if family == "albert":
        return [(model.albert.pooler, torch.tanh), (model.classifier, None)], None, "first"
    if family in ("roberta", "mpnet"):  # the same classification head
        return [(model.classifier.dense, torch.tanh), (model.classifier.out_proj, None)], None, "first"
    if family == "electra":
        head = model.classifier
        return [(head.dense, head.activation), (head.out_proj, None)], None, "first"
    if family == "distilbert":
        return [(model.pre_classifier, torch.relu), (model.classifier, None)], None, "first"
    if family == "deberta-v2":  # ContextPooler: dense, then the configured activation, on [CLS]
        pooler = model.pooler
        return [(pooler.dense, ACT2FN[pooler.config.pooler_hidden_act]), (model.classifier, None)], None, "first"
    if family == "modernbert":  # final norm, [CLS] or mean pooling, then dense → act → LayerNorm → classifier
        head, pool = model.head, model.config.classifier_pooling
        steps: list[Step] = [(head.dense, head.act), Norm(head.norm, rms=False), (model.classifier, None)]
        return steps, Norm(model.base_model.final_norm, rms=False), "mean" if pool == "mean" else "first"
    proj = final_proj(adapter)  # OPT's project_out, between the final norm and the score head
    return [*([(proj, None)] if proj is not None else []), (model.score, None)], final_norm(adapter), "last"


@torch.no_grad()
def decompose(trace: Trace, b: int, value_bias: ValueBias = "values") -> DecompXInput:
    """DecompX of input b of a traced sequence-classification model (trace captured with ffn=True)."""
    adapter = trace.adapter
    steps, final, pool = _head(trace.model, adapter)
    n = int(trace.mask[b].sum())
    norms, sums = [], []
    for x in _propagated(trace, b, value_bias):
        norms.append(x.norm(dim=-1))
        sums.append(x.sum(1))
    rows = slice(0, n) if pool == "mean" else slice(n - 1, n) if pool == "last" else slice(0, 1)
    h = x[rows]  # [r, k, d]
    del x
    if final is not None:
        final_in = trace.layers[-1].out
        assert final_in is not None  # a full trace
        h = _apply_norm(h, final, final_in[b, rows])
    h = h.mean(0, keepdim=True)  # [1, k, d] (one row unless pooled by the mean)
    for step in steps:
        h = _apply_norm(h, step, h.sum(-2)) if isinstance(step, Norm) else _linearised(h, *step)
    scores = h[0].T  # [C, n]
    assert trace.logits is not None  # a full trace of a classifier
    logits = trace.logits[b].float()
    top = logits.abs().max().clamp_min(torch.finfo(logits.dtype).tiny)
    err = ((scores.sum(-1) - logits).abs().max() / top).item()
    return DecompXInput(classes=scores, layers=torch.stack(norms), sums=torch.stack(sums), error=err)


def _propagated(trace: Trace, b: int, value_bias: ValueBias) -> Iterator[torch.Tensor]:
    """Per-source vectors x_{i⇐k} [n(target), n(source), d] of input b after each layer, in layer order."""
    if trace.layers[0].ffn_pre is None:
        raise RuntimeError("decompx needs a trace captured with ffn=True")
    n = int(trace.mask[b].sum())
    x0 = trace.layers[0].x[b, :n].float()
    x = torch.zeros(n, n, x0.shape[-1])
    x[torch.arange(n), torch.arange(n)] = x0
    pre_ln = trace.adapter.family.pre_ln
    for layer, (lt, lay) in enumerate(zip(trace.layers, trace.adapter.layers, strict=True)):
        x = _layer(x, lt, lay, pre_ln, b, own_bias=layer == 0 and value_bias == "values")
        yield x


@torch.no_grad()
def final_parts(trace: Trace, b: int, pos: int, value_bias: ValueBias = "values") -> torch.Tensor:
    """Per-source parts [n(source), d] of input b's final hidden state at position `pos` (after the final norm of
    pre-LN decoders; the head's input). Σ over sources equals the real state. Trace captured with ffn=True."""
    adapter = trace.adapter
    *_, x = _propagated(trace, b, value_bias)
    h = x[pos : pos + 1]  # [1, k, d]
    final = final_norm(adapter) if adapter.family.pre_ln else None
    if final is not None:
        out = trace.layers[-1].out  # [B, n, d]
        assert out is not None  # a full trace (ffn=True) keeps the last layer's output
        h = _apply_norm(h, final, out[b, pos : pos + 1])
    proj = final_proj(adapter)
    if proj is not None:  # OPT's project_out (no bias)
        h = h @ linear_xw(proj)[0].float()
    return h[0]


def decompositions(trace: Trace, value_bias: ValueBias = "values") -> list[DecompXInput]:
    """DecompX of every input of the trace (cached); raises ReconstructionError past the tolerance."""

    def make() -> list[DecompXInput]:
        out = [decompose(trace, b, value_bias) for b in range(trace.mask.shape[0])]
        from mixlens.methods.engine import tolerance

        limit = tolerance(trace.model, TOLERANCE)
        for b, dec in enumerate(out):
            if not dec.error <= limit:
                raise ReconstructionError(
                    f"input {b + 1}: DecompX class scores differ from the logits by "
                    f"{dec.error:.3g} (relative; tolerance {limit})"
                )
        return out

    return memo_of(trace).cached(("decompx", value_bias), make)


VALUE_BIAS_OPTION = Option(
    "value_bias",
    str,
    "values",
    choices=VALUE_BIAS,
    help="first layer's b_V: inside each token's value vector, or shared by AbsDot",
)


def needs_classifier(plan: Planned) -> None:
    """DecompX decomposes through a sequence classifier's head: refuse any other head before the weights load."""
    if plan.head != "sequence-classification":
        raise MixlensError(
            f"decompx needs a sequence-classification model; this one loads as {plan.head}: "
            "give a classifier checkpoint, or --model-head sequence-classification"
        )


@register(
    "decompx",
    needs_ffn=True,
    options=(VALUE_BIAS_OPTION,),
    supports=vector_dense,
    head="classifier",
    precheck=needs_classifier,
    card=Card(
        definition="‖x^l_{i⇐k}‖: every hidden state is a sum of parts x_i = Σ_k x_{i⇐k} carried through attention, "
        "residuals, norms and the FFN (activation linearised at the real pre-activation, biases shared by AbsDot) "
        "(Modarressi et al. 2023).",
        passes="One traced forward pass with the FFN captured, no backward.",
        memory="Parts [n, n, d] per layer in 64 MB chunks of target rows; output [L, n, n]; no row mode.",
        official="mohsenfayyaz/DecompX (`src/modeling_bert.py`, transcribed outside the repository)",
        tolerance="measured 1.2e-6 relative (per-layer norms, 272 SST-2 sentences, value_bias=values)",
        check="an uncommitted transcription of the official code, run by the command in global.md; no test in the "
        "repository runs it (the official default convention is tested by "
        "tests/methods/test_decompx.py::test_default_value_bias_is_the_official_one)",
        background=BACKGROUND,
    ),
)
def decompx(trace: Trace, *, value_bias: ValueBias = "values") -> torch.Tensor:
    """DecompX per layer (Modarressi 2023; classification models): ‖x_{i⇐k}‖, part of layer-l output i from token k."""
    decs = decompositions(trace, value_bias)
    b, n = trace.mask.shape
    out = torch.zeros(b, decs[0].layers.shape[0], n, n)
    for k, dec in enumerate(decs):
        m = dec.layers.shape[-1]
        out[k, :, :m, :m] = dec.layers
    return out


@register(
    "decompx_classes",
    dims=("class", "source"),
    needs_ffn=True,
    options=(VALUE_BIAS_OPTION,),
    supports=vector_dense,
    head="classifier",
    explains=True,
    precheck=needs_classifier,
    card=Card(
        definition="Score_{c,k} = the part of logit c from token k: the DecompX parts carried through the "
        "classification head (pooler / head activations linearised); Σ_k score_{c,k} = logit c (checked, ≤ 1e-3 "
        "relative).",
        passes="One traced forward pass with the FFN captured, no backward.",
        memory="Parts [n, n, d] per layer in 64 MB chunks of target rows; output [C, n].",
        official="mohsenfayyaz/DecompX (`src/modeling_bert.py`, transcribed outside the repository)",
        tolerance="measured 2.0e-6 relative (class scores, 272 SST-2 sentences, value_bias=values)",
        check="an uncommitted transcription of the official code, run by the command in global.md; no test in the "
        "repository runs it (the official default convention is tested by "
        "tests/methods/test_decompx.py::test_default_value_bias_is_the_official_one)",
        background=BACKGROUND,
    ),
)
def decompx_classes(trace: Trace, *, value_bias: ValueBias = "values") -> torch.Tensor:
    """DecompX class scores (classification models): signed contribution of each token to each logit; sums = logits."""
    decs = decompositions(trace, value_bias)
    b, n = trace.mask.shape
    out = torch.zeros(b, decs[0].classes.shape[0], n)
    for k, dec in enumerate(decs):
        out[k, :, : dec.classes.shape[-1]] = dec.classes
    return out
