"""DecompX for causal LMs: the next-token logit decomposed over the source tokens (DESIGN §3.5).

The final hidden state at the last real token, h = Σ_k h_{⇐k} (DecompX propagation, `decompx.final_parts`), enters
the unembedding linearly, so logit_t = Σ_k h_{⇐k} · W_U[t] (+ the head bias shared by AbsDot, if any) exactly; a
contrastive score logit_t − logit_foil decomposes the same way with W_U[t] − W_U[foil]. The sum is checked against
the real logits on every input.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mixlens.adapters import logit_scale
from mixlens.errors import MixlensError, ReconstructionError
from mixlens.methods.decompx import TOLERANCE, final_parts, share
from mixlens.methods.engine import tolerance
from mixlens.methods.registry import TARGET_OPTIONS, Card, register, vector_dense
from mixlens.targets import Spec, readout
from mixlens.trace import Trace

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("global.md", "whole-layer and global attribution")


def _unembedding(trace: Trace) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W_U [V, d], bias [V] or None) of a causal LM head."""
    if not trace.adapter.family.causal or trace.logits is None or trace.logits.dim() != 3:
        raise MixlensError(
            "decompx_logit needs a causal language model (load it with head='causal-lm'); "
            f"got {type(trace.model).__name__}"
        )
    head = trace.model.get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


@torch.no_grad()
def logit_scores(
    trace: Trace, tokens: torch.Tensor, foils: torch.Tensor | None = None, at: torch.Tensor | None = None
) -> torch.Tensor:
    """Signed per-source scores [B, n] of logit(tokens[b]) (− logit(foils[b]) where foils[b] ≥ 0) at position at[b]
    (default: each input's last real token); padding 0. Raises ReconstructionError when a sum misses the real
    score."""
    w_u, bias = _unembedding(trace)
    assert trace.logits is not None  # checked by _unembedding
    bsz, n = trace.mask.shape
    out = torch.zeros(bsz, n, device=trace.mask.device)
    limit = tolerance(trace.model, TOLERANCE)
    head_scale = logit_scale(trace.adapter)  # Granite divides its logits by logits_scaling
    for b in range(bsz):
        pos = int(at[b]) if at is not None else int(trace.mask[b].sum()) - 1
        t, f = int(tokens[b]), int(foils[b]) if foils is not None else -1
        direction = (w_u[t].float() - (w_u[f].float() if f >= 0 else 0)) * head_scale
        parts = final_parts(trace, b, pos)  # [k, d]
        scores = parts @ direction
        real = trace.logit_rows(torch.tensor([pos]), b)[0].float()
        want = real[t] - (real[f] if f >= 0 else 0)
        if bias is not None:  # the head bias, shared among the sources by AbsDot like every other bias
            const = (bias[t].float() - (bias[f].float() if f >= 0 else 0)) * head_scale
            scores = share(scores[:, None], const.reshape(1))[:, 0]
        err = (scores.sum() - want).abs().item() / max(real.abs().max().item(), torch.finfo(real.dtype).tiny)
        if not err <= limit:
            raise ReconstructionError(
                f"input {b + 1}: DecompX logit scores differ from the logit by {err:.3g} (relative; tolerance {limit})"
            )
        out[b, : scores.shape[0]] = scores  # sources after a causal position are 0 (DecompX keeps every token)
    return out


@register(
    "decompx_logit",
    dims=("source",),
    needs_ffn=True,
    options=TARGET_OPTIONS,
    supports=vector_dense,
    head="causal",
    explains=True,
    card=Card(
        definition="score_k = h_{⇐k} · (W_U[target] − W_U[foil]): the DecompX parts of the final hidden state at a "
        "causal LM's target position through the unembedding (head bias shared by AbsDot); Σ_k score_k = the logit "
        "(checked).",
        passes="One traced forward pass with the FFN captured, no backward.",
        memory="Parts [n, n, d] per layer in chunks of target rows; output [n].",
        note="the official DecompX code covers BERT-style classifiers only",
        background=BACKGROUND,
    ),
)
def decompx_logit(
    trace: Trace, *, target: Spec = "pred", foil: int | None = None, position: int | None = None
) -> torch.Tensor:
    """DecompX next-token logit (causal LMs): signed contribution of each token to the target logit (minus the
    foil's); sums = logit."""
    _unembedding(trace)
    if callable(target) and not isinstance(target, str):
        raise MixlensError("decompx_logit decomposes a logit: give a token id or 'pred' as target, not a function")
    _, ro = readout(
        trace.model, trace.tokenizer, SimpleNamespace(logits=trace.logits), trace.inputs, target, foil, position
    )
    return logit_scores(trace, ro.index, ro.foil, ro.position)
