"""ALTI-Logit and its direct variant (Ferrando et al., ACL 2023, "Explaining How Transformers Use Context to Build
Predictions"; docs/reference/global.md "Decoders"): a causal LM's next-token logit — or, with a foil, the logit
difference — split into one score per context token, per layer and summed.

Scalar. At the target position p the final norm is linear once its scale s_f (of the real final state h_L[p]) is
fixed: logit_w = h_L[p] · u + β_f · w + b_U[w], with w = W_U[target] (− W_U[foil]) and u = C(γ_f ⊙ w) / s_f
(C centres for a LayerNorm, is the identity for an RMSNorm). The residual stream is a sum of updates,
h_L = x⁰ + Σ_l (attention update_l + MLP update_l), and each layer's attention update at p is split per source
token and head: Σ_h Σ_j α^h_pj v^h_j W_O^h + b_O, where v^h_j is the real value vector (LN(x_j) W_V + b_V: the
norm's β and the value bias go with their source, the paper's "affine" T(x_j)). Gemma's sandwich norm g_post on
the attention output is linear with its scale s^post_p fixed at the real value: α / s^post_p and W_O diag(γ_post)
(`LayerTrace.alpha_mix`, `Layer.w_o`).

- `logit_attn` (the paper's "Logit", no carry-back): Δ^l_j = Σ_h α^h_pj (v^h_j W_O^h) · u, per layer l and
  source j (per head in the extra `heads`), summed over layers;
- `alti_logit`: each layer's row Δ^l is carried back to the input tokens through the earlier layers' ALTI
  contributions, Δ^l C_{l−1} ⋯ C_0 (C_k: ALTI of layer k, rows normalised to 1; layer 0 is not carried), summed
  over layers. The rows of C sum to 1, so the carry-back keeps each layer's sum.

Remainder (extra `remainder`): x⁰[p]·u (the embedding's own path) + Σ_l b_O·u + Σ_l (MLP update_l[p])·u
(per layer in the extra `mlp`) + β_f·w + b_U. Σ_j score_j + remainder equals the model's logit (difference); every
run checks it against the model's own logits (to `TOLERANCE`, relative to the largest |logit| at p) and checks
each layer's attention output rebuilt from α and the value vectors against the real one before the ALTI
matrices are built from them (`ReconstructionError` on a miss). Gemma 2's final soft cap c·tanh(z / c) is not
linear: the scalar explained there is the logit before the cap, z (same ranking); the check compares c·tanh(z / c)
with the model's logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from mixlens.adapters import Adapter, Family, Layer, Norm, final_norm, final_proj, linear_xw, logit_scale
from mixlens.errors import MixlensError, ReconstructionError
from mixlens.methods.alti import ALTI, layer_fn
from mixlens.methods.engine import ATTN_TOLERANCES, attn_sum, run_dtype, tolerance
from mixlens.methods.memo import memo_of
from mixlens.methods.registry import TARGET_OPTIONS, TRACED, Card, MethodOutput, register
from mixlens.methods.rollout import ROW_CHUNK
from mixlens.targets import Spec, readout
from mixlens.trace import LayerTrace, Trace, repeat_kv

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("global.md", "ALTI-Logit")
ALTI_LOGIT_CHECK = (
    "tests/methods/test_alti_logit.py::test_equals_the_authors_code_on_gpt2 (and "
    "::test_equals_the_authors_code_on_opt_and_bloom); skipped unless MIXLENS_LOGIT_EXPLANATIONS names a checkout"
)

TOLERANCE = 1e-4  # max |Σ scores + remainder − logit| / max |logit at the target position|, float32 models
ATTN_TOLERANCE = 1e-4  # max |rebuilt − real attention output| / max(1, max |real|), per layer, float32 models
# (a bfloat16 / float16 model: the rounding tolerances of its dtype, `norms.tolerance` / `norms.ATTN_TOLERANCES`)
EXTRAS = {"layers": ("layer", "source"), "mlp": ("layer",), "remainder": ()}


def decoder_only(family: Family) -> str | None:
    """Pre-LN causal decoders (GPT-2, Llama-style, Gemma 2/3): the next-token logit of a causal LM head."""
    if not family.causal:
        return f"it explains a causal decoder's next-token logit, and {family.name} is an encoder"
    if not family.pre_ln:
        return "it splits a pre-LN residual stream into updates; this post-LN decoder renormalises every residual sum"
    return None


@dataclasses.dataclass
class Direct:
    """The direct decomposition of one batch: `heads` [B, L, H, n] per-head, per-source logit (difference) terms;
    `mlp` [B, L] the MLP updates' terms; `remainder` [B] everything but the per-source attention terms."""

    heads: torch.Tensor
    mlp: torch.Tensor
    remainder: torch.Tensor
    positions: torch.Tensor  # [B] target positions


def _check_head(trace: Trace, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W_U [V, d], b_U or None) of a causal LM head; one line otherwise."""
    if not trace.adapter.family.causal or trace.logits is None or trace.logits.dim() != 3:
        raise MixlensError(
            f"{name} needs a causal language model (load it with head='causal-lm'); got {type(trace.model).__name__}"
        )
    head = trace.model.get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


def _final_norm(trace: Trace) -> Norm:
    """The norm between the last layer and the unembedding (GPT-2's ln_f, Llama's and Gemma's norm)."""
    return _final_norm_of(trace.adapter)


def _final_norm_of(adapter: Adapter) -> Norm:
    norm = final_norm(adapter)
    if norm is None:
        raise MixlensError(f"cannot find the final norm of {type(adapter.base).__name__}")
    return norm


def _softcap_of(model: torch.nn.Module) -> float | None:
    """Gemma 2's final logit soft cap c (None without one)."""
    cap = getattr(model.config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def _mixing(lt: LayerTrace) -> LayerTrace:
    """The layer as its attention output mixes the values: α / s^post with a sandwich norm (γ_post is in W_O)."""
    if lt.post_scale is None:
        return lt
    if lt.qk is not None:
        return dataclasses.replace(lt, qk=dataclasses.replace(lt.qk, row_scale=lt.post_scale), post_scale=None)
    return dataclasses.replace(lt, alpha=lt.alpha_mix, post_scale=None)


def row_chunks(mask: torch.Tensor) -> list[torch.Tensor]:
    """Every position of a [B, n] batch as chunks of `ROW_CHUNK` target rows [B, c]."""
    b, n = mask.shape
    at = torch.arange(n, device=mask.device)
    return [at[s : s + ROW_CHUNK].expand(b, -1) for s in range(0, n, ROW_CHUNK)]


def rebuilt_attention(alpha: torch.Tensor, values: torch.Tensor, lay: Layer) -> torch.Tensor:
    """Σ_j Σ_h α^h_ij f^h(x_j) + b_O from rows of α [B, H, K, n] (as the layer mixes, `_mixing`) and the value
    vectors [B, H, n, d_h]: [B, K, d]."""
    z = torch.matmul(alpha, values)  # [B, H, K, d_h]
    out = z.transpose(1, 2).flatten(2) @ lay.w_o.float()
    return out + lay.b_o.float() if lay.b_o is not None else out


class LogitTerms:
    """The direct logit terms of R readouts of input `b`, accumulated one layer at a time (`add`, layers in order),
    so that a layer's tensors can be dropped once added (a streamed trace: `run_traced(sink=)`). Readout r is the
    logit of token ids[r] at position positions[r] (the unembedding row w_r, times the logit scale, through a final
    projection). The final norm's scale s_f of the real last state h_L[p_r] is known only after the last layer, and
    every term through the norm is linear in u_r = C(γ ⊙ w_r) / s_f: the layers add their terms with
    u⁰_r = C(γ ⊙ w_r) and `finish` divides by s_f.

    Memory: R · layers · heads · n floats (the per-head terms) plus R · d per layer; no layer tensor is kept."""

    @torch.no_grad()
    def __init__(self, adapter: Adapter, model: Any, b: int, positions: torch.Tensor, ids: list[int]):
        head = model.get_output_embeddings()
        w_u, b_u = head.weight, getattr(head, "bias", None)
        norm, proj, head_scale = _final_norm_of(adapter), final_proj(adapter), logit_scale(adapter)
        self.adapter, self.norm, self.b, self.ids = adapter, norm, b, list(ids)
        self.positions = positions  # [R]
        dev = positions.device
        w = w_u[self.ids].float().to(dev) * head_scale  # [R, d]
        if proj is not None:  # a linear map between the final norm and the unembedding (OPT's project_out)
            w = w @ linear_xw(proj)[0].float().T.to(dev)
        self.u0 = norm.center(norm.weight.to(dev) * w)  # [R, d]: u_r · s_f
        self.fixed = (norm.shift().to(dev) * w).sum(-1)  # [R]: β_f · w (+ b_U), no s_f in it
        if b_u is not None:
            self.fixed = self.fixed + b_u[self.ids].float().to(dev) * head_scale
        r, n_layers, n_heads = len(self.ids), adapter.n_layers, adapter.n_heads
        self.heads: torch.Tensor | None = None  # [R, L, H, n] once the first layer gives n
        self.mlp = torch.zeros(r, n_layers, device=dev)  # [R, L] (times s_f until `finish`)
        self.linear = torch.zeros(r, device=dev)  # [R] embedding path + output biases (times s_f until `finish`)
        self.last: torch.Tensor | None = None  # [R, d] h_L at the readout positions
        self.n_heads = n_heads

    @torch.no_grad()
    def add(self, m: int, lt: LayerTrace) -> None:
        """Layer m's terms, from its trace (α's rows at the readout positions, v, the residual sums there)."""
        lay, b, pos, u0 = self.adapter.layers[m], self.b, self.positions, self.u0
        n = lt.value.shape[-2]
        if self.heads is None:
            self.heads = torch.zeros(len(self.ids), self.adapter.n_layers, self.n_heads, n, device=u0.device)
        alpha = lt.alpha_rows(pos, mix=True, b=b).transpose(0, 1)  # [R, H, n]
        alpha = alpha * (torch.arange(n, device=pos.device) <= pos[:, None])[:, None, :]  # causal: j ≤ p_r
        v = repeat_kv(lt.value[b : b + 1], self.n_heads)[0].float()  # [H, n, d_h]
        g = torch.einsum("hkd,rd->rhk", lay.w_o.float().reshape(self.n_heads, lay.d_head, -1), u0)  # W_O^h u⁰
        self.heads[:, m] = alpha * torch.einsum("hjk,rhk->rhj", v, g)
        if lay.b_o is not None:
            self.linear += u0 @ lay.b_o.float()
        if m == 0:
            self.linear += (lt.x[b, pos].float() * u0).sum(-1)
        out = lt.out
        assert out is not None  # a full trace (the method reads the head: `Method.needs_output`)
        self.mlp[:, m] = ((out[b, pos].float() - lt.mix_in[b, pos].float()) * u0).sum(-1)
        if m == self.adapter.n_layers - 1:
            self.last = out[b, pos].float()

    @torch.no_grad()
    def finish(self, logits: torch.Tensor, model: torch.nn.Module, name: str, where: str) -> Direct:
        """The terms of every readout, divided by s_f: `Direct` with heads [R, L, H, n], mlp [R, L] and remainder [R]
        (one readout a row, not summed); checked against the model's logits at the readout positions [R, V]
        (`ReconstructionError` on a miss, `where` names the input)."""
        assert self.heads is not None and self.last is not None, "every layer must be added first"
        s_f = self.norm.scale(self.last)  # [R]
        heads = self.heads.div_(s_f[:, None, None, None])
        mlp = self.mlp / s_f[:, None]
        rest = mlp.sum(1) + self.linear / s_f + self.fixed
        z = heads.sum((1, 2, 3)) + rest  # [R] the logits before any soft cap
        cap = _softcap_of(model)
        rebuilt = cap * torch.tanh(z / cap) if cap else z
        rows = logits.float().to(z.device)
        real = rows[torch.arange(len(self.ids), device=z.device), torch.tensor(self.ids, device=z.device)]
        scale = rows.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
        err = ((rebuilt - real).abs() / scale).max().item()
        limit = tolerance(model, TOLERANCE)
        if not err <= limit:  # NaN fails too
            raise ReconstructionError(
                f"{where}: {name} terms differ from the logit by {err:.3g} (relative; tolerance {limit})"
            )
        return Direct(heads, mlp, rest, self.positions)


@torch.no_grad()
def direct_terms(trace: Trace, name: str, target: Spec, foil: int | None, position: int | None) -> Direct:
    """Per-layer, per-head, per-source logit (difference) terms at each input's target position, with the
    remainder; checks the sum against the model's logits (`ReconstructionError` on a miss)."""
    _check_head(trace, name)
    if callable(target) and not isinstance(target, str):
        raise MixlensError(f"{name} decomposes a logit: give a token id or 'pred' as target, not a function")
    assert trace.logits is not None
    _, ro = readout(
        trace.model, trace.tokenizer, SimpleNamespace(logits=trace.logits), trace.inputs, target, foil, position
    )
    _final_norm(trace)
    layers = trace.layers
    assert layers[-1].out is not None  # a full trace (the method reads the head: `Method.needs_output`)
    bsz, n = trace.mask.shape
    dev = layers[-1].out.device
    heads = torch.zeros(bsz, len(layers), trace.adapter.n_heads, n, device=dev)
    mlp = torch.zeros(bsz, len(layers), device=dev)
    rest = torch.zeros(bsz, device=dev)
    for b in range(bsz):
        p = int(ro.position[b])
        ids = [int(ro.index[b])] + ([int(ro.foil[b])] if int(ro.foil[b]) >= 0 else [])
        at = torch.full((len(ids),), p, device=dev)  # the target's logit (and the foil's) at p
        terms = LogitTerms(trace.adapter, trace.model, b, at, ids)
        for m, lt in enumerate(layers):
            terms.add(m, lt)
        d = terms.finish(trace.logit_rows(at, b), trace.model, name, f"input {b + 1}")
        sign = torch.tensor([1.0, -1.0][: len(ids)], device=dev)
        heads[b] = torch.einsum("c,clhj->lhj", sign, d.heads)
        mlp[b] = sign @ d.mlp
        rest[b] = sign @ d.remainder
    return Direct(heads, mlp, rest, ro.position)


def _alti_layers(trace: Trace) -> Callable[[int], torch.Tensor]:
    """Layer k → its ALTI contributions [B, n, n], rows normalised (the `alti` method's matrices; with a sandwich
    norm, those of the attention output α / s^post). Each layer's attention output is first rebuilt from α and the
    value vectors and checked against the real one."""
    fam, mask = trace.adapter.family, trace.mask
    cached = memo_of(trace).get(ALTI) if memo_of(trace).rows is None else None
    dtype = run_dtype(trace.model)
    limit = ATTN_TOLERANCE if dtype == torch.float32 else ATTN_TOLERANCES.get(dtype, ATTN_TOLERANCES[torch.float16])

    def layer(k: int) -> torch.Tensor:
        lt, lay = _mixing(trace.layers[k]), trace.adapter.layers[k]
        real = lt.attn_out.float()
        m = mask[..., None]
        top = max(1.0, (real * m).abs().max().item())
        if lt.qk is None:
            rebuilt = attn_sum(lt, lay) + (lay.b_o.float() if lay.b_o is not None else 0)
            check(rebuilt - real, m, top, k)
            if cached is not None and lt is trace.layers[k]:
                return cached[:, k]
            return layer_fn(lt, lay, fam.pre_ln, mask, fam.causal)(None)
        # row mode: α's rows a block at a time, each block checked and then used for the ALTI rows
        fn = layer_fn(lt, lay, fam.pre_ln, mask, fam.causal)
        values = repeat_kv(lt.value, lay.n_heads).float()
        parts = []
        for rows in row_chunks(mask):
            a = lt.alpha_rows(rows)
            at = slice(int(rows[0, 0]), int(rows[0, -1]) + 1)
            check(rebuilt_attention(a, values, lay) - real[:, at], m[:, at], top, k)
            parts.append(fn(rows, a))
        return torch.cat(parts, dim=1)

    def check(diff: torch.Tensor, m: torch.Tensor, top: float, k: int) -> None:
        err = (diff * m).abs().max().item() / top
        if not err <= limit:
            raise ReconstructionError(
                f"layer {k}: the attention output rebuilt from α and the values differs by {err:.3g} "
                f"(relative; tolerance {limit})"
            )

    return layer


def carry_back(rows: torch.Tensor, layer: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """rows [B, L, n] (row l: the per-source terms of layer l, over that layer's input tokens) → each row l carried
    to the input tokens, rows[l] C_{l−1} ⋯ C_0, [B, L, n]. Layers from the top down: at layer k every row above k
    is multiplied by C_k (one matrix product per layer; each C_k is built once)."""
    out = rows.clone()
    for k in range(rows.shape[1] - 2, -1, -1):
        c = layer(k).to(out.device)  # [B, n, n]
        out[:, k + 1 :] = torch.matmul(out[:, k + 1 :], c)
    return out


def _check_sum(name: str, values: torch.Tensor, direct: torch.Tensor, trace: Trace, at: torch.Tensor) -> None:
    """Carried-back sums against the direct ones (the rows of C sum to 1), relative to the largest |logit|."""
    assert trace.logits is not None
    rows = trace.logit_rows(at).float()
    scale = rows.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny).to(values.device)
    err = ((values.sum(-1) - direct.sum(-1)).abs() / scale[:, None]).max().item()
    if not err <= TOLERANCE:  # both sides are float32 sums of the same terms, whatever the model's dtype
        raise ReconstructionError(
            f"{name}: the carried-back scores lost {err:.3g} of the logit (relative; tolerance {TOLERANCE}); "
            "an ALTI row without any contribution"
        )


@register(
    "logit_attn",
    layered_rows=True,
    dims=("source",),
    options=TARGET_OPTIONS,
    extras={**EXTRAS, "heads": ("layer", "head", "source")},
    supports=decoder_only,
    head="causal",
    explains=True,
    qk_rows=True,
    recommended=("causal",),  # level with attnlrp on BLiMP, one forward pass and exact (docs/findings/evaluate.md)
    card=Card(
        definition="score_j = Σ_l Δ^l_j, Δ^l_j = Σ_h α^h_pj (v^h_j W_O^h)·u: each layer's attention update at the "
        "target position p split per source, on the logit direction u = C(γ_f ⊙ w)/s_f, w = W_U[target] (− "
        "W_U[foil]) (Ferrando et al. 2023, no carry-back); Σ_j score_j + remainder = the model's logit (checked).",
        passes=TRACED + " (a causal LM's logit at the target position).",
        memory="[L, n] per-layer terms (extra), α read by rows (no [H, n, n] on a causal LM); output [n].",
        official="mt-upc/logit-explanations (`src/contributions.py`, the authors' code)",
        tolerance="asserted < 1e-4 relative to the largest direct term; measured 3.6e-7 per layer, 2.7e-7 per head "
        "(GPT-2); ≤ 3.4e-7 on OPT and BLOOM (pairwise eps 0)",
        check=ALTI_LOGIT_CHECK,
        background=BACKGROUND,
    ),
)
def logit_attn(
    trace: Trace, *, target: Spec = "pred", foil: int | None = None, position: int | None = None
) -> MethodOutput:
    """Logit (Ferrando 2023, no carry-back): each layer's attention update split per source, on the target logit
    (minus the foil's); + remainder = logit."""
    d = direct_terms(trace, "logit_attn", target, foil, position)
    layers = d.heads.sum(2)
    return MethodOutput(
        layers.sum(1).cpu(),
        {"layers": layers.cpu(), "heads": d.heads.cpu(), "mlp": d.mlp.cpu(), "remainder": d.remainder.cpu()},
    )


@register(
    "alti_logit",
    default_in={"logit-layers": 0},
    dims=("source",),
    options=TARGET_OPTIONS,
    extras=EXTRAS,
    supports=decoder_only,
    head="causal",
    explains=True,
    qk_rows=True,
    card=Card(
        definition="score_j = Σ_l (Δ^l C_{l−1} ⋯ C_0)_j: logit_attn's per-layer rows Δ^l carried back to the input "
        "tokens through the ALTI matrices C_k of the layers below (Ferrando et al. 2023); Σ_j score_j + remainder = "
        "the model's logit (checked).",
        passes=TRACED + " (a causal LM's logit at the target position).",
        memory="[L, n] per-layer terms (extra) plus one layer's ALTI matrix [n, n] at a time for the carry-back "
        "(built in blocks of 256 rows); α read by rows; output [n].",
        official="mt-upc/logit-explanations (`contributions.py` run unchanged; its normalisation, rollout and "
        "carry-back restated in the test)",
        tolerance="asserted < 1e-4 relative to the largest direct term; measured 6.9e-5 with the authors' pairwise "
        "eps, 1.0e-6 per layer with it set to 0 (GPT-2); ≤ 9.1e-7 on OPT and BLOOM (pairwise eps 0)",
        check=ALTI_LOGIT_CHECK,
        background=BACKGROUND,
    ),
)
def alti_logit(
    trace: Trace, *, target: Spec = "pred", foil: int | None = None, position: int | None = None
) -> MethodOutput:
    """ALTI-Logit (Ferrando 2023): per-layer logit terms of the attention carried back to the input tokens through
    ALTI; + remainder = logit."""
    d = direct_terms(trace, "alti_logit", target, foil, position)
    direct = d.heads.sum(2)
    layers = carry_back(direct, _alti_layers(trace))
    _check_sum("alti_logit", layers, direct, trace, d.positions)
    return MethodOutput(
        layers.sum(1).cpu(), {"layers": layers.cpu(), "mlp": d.mlp.cpu(), "remainder": d.remainder.cpu()}
    )
