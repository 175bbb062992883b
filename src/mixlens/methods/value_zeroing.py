"""Value zeroing (Mohebbi et al. 2023; docs/DESIGN.md §3.5): re-run one layer with the value vector of token j zeroed.

For layer l and source j, the model runs layer l alone again on its captured input x (the engine's start/stop
options; FFN, both norms and the residuals act exactly as in the model) with v_j = 0 in every (key/value) head
(edit point `blocks.{l}.attn.v`). α does not depend on the values, so it is the original one. C_ij = cosine
distance between the new and the real output of token i, rows normalised to 1; global = rollout. The n zeroed
copies of a batch are stacked along the batch axis and run in as few calls as the memory bound allows. Causal
models need no special case: zeroing v_j cannot reach i < j.
"""

from __future__ import annotations

import torch

from mixlens.methods.memo import memo_of
from mixlens.methods.registry import TARGET_OPTIONS, TARGET_SCORES, Card, register
from mixlens.methods.rollout import pair_mask, rollout, row_normalize
from mixlens.targets import Spec, readout, trace_output
from mixlens.trace import Trace, hooked

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("global.md", "whole-layer and global attribution")

MAX_TOKENS_PER_CALL = 1 << 13  # examples·copies·n tokens in one layer call (activations stay near cache)


def _zeroed_outputs(trace: Trace, index: int, rows: torch.Tensor, sources: range) -> torch.Tensor:
    """Output of layer `index` for the examples `rows` with v_j = 0, for each j in `sources`:
    [len(rows), len(sources), n, d]. The model runs layer `index` alone on its captured input x, over the rows
    repeated len(sources) times (example-major)."""
    x = trace.layers[index].x
    _, n, d = x.shape
    m = len(sources)
    keep = torch.ones(m, n, dtype=x.dtype, device=x.device)
    keep[torch.arange(m), torch.arange(sources.start, sources.stop)] = 0
    keep = keep.repeat(len(rows), 1)[:, None, :, None]  # [R·m, 1, n(source), 1]
    inputs = {k: v[rows.to(v.device)].repeat_interleave(m, dim=0) for k, v in trace.inputs.items()}
    extra = {"use_cache": False} if trace.adapter.family.causal else {}
    x_in = x[rows.to(x.device)].repeat_interleave(m, dim=0)  # [R·m, n, d]
    with hooked(
        trace.adapter, {f"blocks.{index}.attn.v": lambda v: v * keep}, start=index, resid_pre=x_in, stop_after=index
    ) as rec:
        trace.model(**inputs, **extra)
    return rec["out"][0].reshape(len(rows), m, n, d)


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1 − cos(a, b) over the last axis as ½‖â − b̂‖², in float64: no cancellation when a ≈ b."""
    a, b = a.double(), b.double()
    eps = torch.finfo(torch.float64).tiny
    diff = a / a.norm(dim=-1, keepdim=True).clamp_min(eps) - b / b.norm(dim=-1, keepdim=True).clamp_min(eps)
    return (0.5 * diff.pow(2).sum(-1)).float()


def _layer(trace: Trace, index: int) -> torch.Tensor:
    """C [B, n(target), n(source)]: cosine distance of each token's output when source j's value is zeroed.
    Sources that are padding of an example are skipped for that example."""
    real = trace.layers[index].out  # [B, n, d]
    assert real is not None  # a full trace
    b, n, _ = real.shape
    lengths = torch.tensor(trace.lengths)
    out = torch.zeros(b, n, n)
    s = 0
    while s < n:
        rows = torch.nonzero(lengths > s).flatten()  # examples for which source s is a real token
        step = max(1, MAX_TOKENS_PER_CALL // (len(rows) * n))
        src = range(s, min(n, s + step))
        zeroed = _zeroed_outputs(trace, index, rows, src)  # [R, m, n(target), d]
        out[rows, :, s : src.stop] = cosine_distance(zeroed, real[rows, None]).transpose(1, 2)
        s = src.stop
    return out


def value_zeroing_matrices(trace: Trace) -> torch.Tensor:
    """Per-layer value-zeroing matrices, rows normalised: [B, L, n, n] (cached on the trace)."""

    def make() -> torch.Tensor:
        with torch.no_grad():
            mats = torch.stack([_layer(trace, i) for i in range(trace.adapter.n_layers)], dim=1)
        return row_normalize(mats.clamp_min(0) * pair_mask(trace.mask))

    return memo_of(trace).cached("value_zeroing", make)


@register(
    "value_zeroing",
    extra_passes=True,
    card=Card(
        definition="VZ_ij = cosine distance between layer l's output at i and the same with value vector j zeroed in "
        "every head, rows normalised (Mohebbi et al. 2023).",
        passes="One traced forward pass, then n single-layer passes per layer (stacked, at most 8192 tokens a call); "
        "no backward.",
        memory="[L, n, n]; no row mode.",
        background=BACKGROUND,
    ),
)
def value_zeroing(trace: Trace) -> torch.Tensor:
    """Value zeroing (Mohebbi 2023): cosine distance of layer outputs when value j is zeroed, rows normalised."""
    return value_zeroing_matrices(trace)


@register(
    "value_zeroing_rollout",
    extra_passes=True,
    explains=True,
    card=Card(
        definition="R_l = VZ_l R_{l−1}, the product of the per-layer value-zeroing matrices.",
        passes="As value_zeroing: one traced forward pass and n single-layer passes per layer.",
        memory="[L, n, n]; no row mode.",
        background=BACKGROUND,
    ),
)
def value_zeroing_rollout(trace: Trace) -> torch.Tensor:
    """Value-zeroing global attribution: rollout of the per-layer matrices over layers 1..l."""
    return rollout(value_zeroing_matrices(trace))


@register(
    "value_zeroing_logit",
    options=TARGET_OPTIONS,
    **TARGET_SCORES,
    card=Card(
        definition="s_j = g(x) − g(x with token j's value vectors zeroed in every layer).",
        passes="n forward passes per input (token j's values zeroed), plus the unedited one (shared when traced); no "
        "backward.",
        memory="The n zeroed copies stacked on the batch axis, at most 8192 tokens a call; output [n].",
        background=BACKGROUND,
    ),
)
def value_zeroing_logit(
    trace: Trace, *, target: Spec = "pred", foil: int | None = None, position: int | None = None
) -> torch.Tensor:
    """Value zeroing of a prediction: g(x) − g(x with token j's value vectors zeroed in every layer), for the
    explained scalar g (a logit, a logit difference with a foil, or an encoder's pooled projection): [B, source]."""
    out = trace_output(trace)
    _, ro = readout(trace.model, trace.tokenizer, out, trace.inputs, target, foil, position)
    g0 = ro.g(out, trace.inputs).detach().float()  # [B]
    b, n = trace.mask.shape
    lengths = torch.tensor(trace.lengths)
    scores = torch.zeros(b, n)
    extra = {"use_cache": False} if trace.adapter.family.causal else {}
    s = 0
    while s < n:
        rows = torch.nonzero(lengths > s).flatten()  # examples for which source s is a real token
        m = min(n - s, max(1, MAX_TOKENS_PER_CALL // (len(rows) * n)))
        keep = torch.ones(m, n, device=trace.mask.device)
        keep[torch.arange(m), torch.arange(s, s + m)] = 0
        keep = keep.repeat(len(rows), 1)[:, None, :, None]  # [R·m, 1, n(source), 1]
        rep = rows.repeat_interleave(m)  # the example of each copy
        inputs = {k: v[rep.to(v.device)] for k, v in trace.inputs.items()}

        def zero(v: torch.Tensor, keep: torch.Tensor = keep) -> torch.Tensor:
            return v * keep.to(v.dtype)

        edits = {f"blocks.{layer}.attn.v": zero for layer in range(trace.adapter.n_layers)}
        with torch.no_grad(), hooked(trace.adapter, edits):
            zeroed = trace.model(**inputs, **extra)
        g = ro.select(rep).g(zeroed, inputs).detach().float().reshape(len(rows), m)
        scores[rows, s : s + m] = (g0[rows, None] - g).cpu()
        s += m
    return scores * trace.mask.cpu().float()
