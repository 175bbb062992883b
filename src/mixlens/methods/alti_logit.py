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

import torch

from mixlens.adapters import Family, Layer, Norm, final_norm, final_proj, linear_xw, logit_scale
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
    norm = final_norm(trace.adapter)
    if norm is None:
        raise MixlensError(f"cannot find the final norm of {type(trace.adapter.base).__name__}")
    return norm


def _softcap(trace: Trace) -> float | None:
    cap = getattr(trace.model.config, "final_logit_softcapping", None)
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


@torch.no_grad()
def direct_terms(trace: Trace, name: str, target: Spec, foil: int | None, position: int | None) -> Direct:
    """Per-layer, per-head, per-source logit (difference) terms at each input's target position, with the
    remainder; checks the sum against the model's logits (`ReconstructionError` on a miss)."""
    w_u, b_u = _check_head(trace, name)
    if callable(target) and not isinstance(target, str):
        raise MixlensError(f"{name} decomposes a logit: give a token id or 'pred' as target, not a function")
    assert trace.logits is not None
    _, ro = readout(
        trace.model, trace.tokenizer, SimpleNamespace(logits=trace.logits), trace.inputs, target, foil, position
    )
    norm, cap, proj, head_scale = (
        _final_norm(trace),
        _softcap(trace),
        final_proj(trace.adapter),
        logit_scale(trace.adapter),
    )
    layers, adapter = trace.layers, trace.adapter
    last = layers[-1].out
    assert last is not None  # a full trace (the method reads the head: `Method.needs_output`)
    bsz, n = trace.mask.shape
    n_layers, n_heads = len(layers), adapter.n_heads
    dev = last.device
    heads = torch.zeros(bsz, n_layers, n_heads, n, device=dev)
    mlp = torch.zeros(bsz, n_layers, device=dev)
    rest = torch.zeros(bsz, device=dev)
    gamma, beta = norm.weight.float(), norm.shift().float()
    limit = tolerance(trace.model, TOLERANCE)
    for b in range(bsz):
        p = int(ro.position[b])
        ids = [int(ro.index[b])] + ([int(ro.foil[b])] if int(ro.foil[b]) >= 0 else [])
        w = w_u[ids].float().to(dev) * head_scale  # [c, d]: the target's row (and the foil's), times the logit scale
        if proj is not None:  # a linear map between the final norm and the unembedding (OPT's project_out)
            w = w @ linear_xw(proj)[0].float().T.to(dev)
        h = last[b, p].float()
        u = norm.center(gamma * w) / norm.scale(h)  # [c, d]: h · u = (γ ⊙ C(h) / s_f) · w
        parts = torch.zeros(len(ids), n_layers, n_heads, p + 1, device=dev)  # per direction
        other = layers[0].x[b, p].float() @ u.T + beta @ w.T  # [c]: embedding path + final-norm bias
        if b_u is not None:
            other = other + b_u[ids].float().to(dev) * head_scale
        mlp_c = torch.zeros(len(ids), n_layers, device=dev)
        for m, (lt, lay) in enumerate(zip(layers, adapter.layers, strict=True)):
            alpha = lt.alpha_rows(torch.tensor([p], device=dev), mix=True, b=b)[:, 0, : p + 1]  # [H, j]
            v = repeat_kv(lt.value[b : b + 1, :, : p + 1], n_heads)[0].float()  # [H, j, d_h]
            g = torch.einsum("hkd,cd->chk", lay.w_o.float().reshape(n_heads, lay.d_head, -1), u)  # W_O^h u
            parts[:, m] = alpha * torch.einsum("hjk,chk->chj", v, g)
            if lay.b_o is not None:
                other = other + lay.b_o.float() @ u.T
            out = lt.out
            assert out is not None
            mlp_c[:, m] = (out[b, p].float() - lt.mix_in[b, p].float()) @ u.T
        z = parts.sum((1, 2, 3)) + mlp_c.sum(1) + other  # [c] the logits before any soft cap
        real_row = trace.logit_rows(torch.tensor([p]), b)[0].float()
        real = real_row[ids]
        rebuilt = cap * torch.tanh(z / cap) if cap else z
        scale = max(real_row.abs().max().item(), torch.finfo(torch.float32).tiny)
        err = (rebuilt - real).abs().max().item() / scale
        if not err <= limit:  # NaN fails too
            raise ReconstructionError(
                f"input {b + 1}: {name} terms differ from the logit by {err:.3g} (relative; tolerance {limit})"
            )
        sign = torch.tensor([1.0, -1.0][: len(ids)], device=dev)
        heads[b, :, :, : p + 1] = torch.einsum("c,clhj->lhj", sign, parts)
        mlp[b] = sign @ mlp_c
        rest[b] = sign @ (mlp_c.sum(1) + other)
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
