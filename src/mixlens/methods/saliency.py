"""Output saliency for one scalar per input (DESIGN §3.7): gradient, gradient × input, integrated gradients.

The scalar is the one of `mixlens.targets`: a class logit (sequence classifier), a token's logit at one position
(masked LM: the [MASK]; causal LM: the last token), minus a foil's logit when one is given, an encoder's pooled
embedding projected on its unperturbed value, or any function `target(model_output, inputs) -> [B]` given in
Python. Attribution is
at the word-embedding output e_j (the engine's edit point `embed` replaces it, so position embeddings and
LayerNorm are applied exactly once), reduced over hidden dims: ‖·‖₂ (default), ‖·‖₁ or the signed sum. Integrated
gradients come from captum; with reduction='sum' they satisfy Σ_j IG_j ≈ f(x) − f(baseline) up to captum's
convergence delta Σ_j IG_j − (f(x) − f(baseline)). An LM target's logits are computed at its position only.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from mixlens.errors import MixlensError
from mixlens.memory import backward_bytes, check_fits
from mixlens.methods.memo import memo_of
from mixlens.methods.registry import TARGET_OPTIONS, TARGET_SCORES, Card, MethodOutput, Option, Reference, get, register
from mixlens.targets import Readout, Request, Spec, model_kind, positions, readout
from mixlens.trace import Trace, hooked, recomputed_layers

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("gradients.md", "gradient attributions")

MAX_STEPS = 1024  # integration steps: chunked (memory stays flat), but the time grows with them

REDUCTIONS = ("l2", "l1", "sum")
KINDS = ("saliency", "grad_x_input", "integrated_gradients")
BASELINES = ("zero", "pad")
IG_TOKENS_PER_CHUNK = 2048  # default tokens per integrated-gradients chunk (input × step rows × tokens)
FUSED_ATTENTION = True  # gradient passes through torch's fused attention (no [B, H, n, n] kept for the backward)
RECOMPUTE_LAYERS = True  # each layer recomputed in the backward (False: every layer's activations kept; tests' oracle)
Target = Spec


@dataclass
class OutputAttribution:
    """Per-token scores [B, n] (padding 0), the raw per-dimension attribution [B, n, d], the target value
    f(x) [B], and for integrated gradients f(baseline) [B] and captum's convergence delta [B]."""

    values: torch.Tensor
    raw: torch.Tensor
    target_value: torch.Tensor
    baseline_value: torch.Tensor | None = None
    delta: torch.Tensor | None = None


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes `logits_to_keep` (the unembedding of chosen positions only)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def per_row_keep(model: torch.nn.Module) -> bool:
    """Whether the model's code reads a 2-D `logits_to_keep` as positions per row (transformers'
    `slice_logits_to_keep`); older model code indexes the position axis with it, which takes only a 1-D one."""
    return getattr(sys.modules[type(model).__module__], "slice_logits_to_keep", None) is not None


class LogitRows:
    """Which logit rows an LM forward computes. Models whose forward takes transformers' `logits_to_keep` compute
    them only at the target positions, so the head's forward and backward cost scale with inputs, not tokens: each
    row's own position (2-D `logits_to_keep` [R, 1], `each`) or, where the model's code only takes a 1-D one, the
    union of the batch's positions (`kept` [K]). Any other model (a classifier, an encoder, or a Python callable
    target) computes all."""

    def __init__(self, trace: Trace, kind: str, target: Target, pos: torch.Tensor):
        self.each, self.kept = False, None
        model = trace.model
        if callable(target) or kind not in ("causal", "masked") or not keeps_logits(model):
            return
        if per_row_keep(model):
            self.each = True
        else:
            self.kept = torch.unique(pos.to(trace.mask.device))

    def kwargs(self, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model call's keyword arguments for rows whose target positions are `pos` [R]."""
        if self.each:
            return {"logits_to_keep": pos[:, None]}
        return {} if self.kept is None else {"logits_to_keep": self.kept}

    def row_at(self, pos: torch.Tensor) -> torch.Tensor | None:
        """Each row's index [R] on the position axis of the logits computed with `kwargs(pos)`; None: all computed
        (read at `pos` itself)."""
        if self.each:
            return torch.zeros_like(pos)
        return None if self.kept is None else torch.searchsorted(self.kept, pos.to(self.kept.device))


def _forward(trace: Trace, emb: torch.Tensor, inputs: dict[str, torch.Tensor], kwargs: dict[str, torch.Tensor]):
    """The model's output with the word embeddings replaced by `emb` [B, n, d] (edit point `embed`, no capture;
    attention in torch's fused kernels when `FUSED_ATTENTION`: its backward keeps no [B, H, n, n] per layer)."""
    with hooked(trace.adapter, {"embed": lambda _: emb}, fused_attention=FUSED_ATTENTION):
        return trace.model(**inputs, **kwargs)


def scalar_fn(
    trace: Trace, target: Target = "pred", foil: int | None = None, position: int | None = None, grad: bool = False
) -> tuple[Callable[..., torch.Tensor], torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor, Readout]:
    """(g(emb [B, n, d], *inputs, *readout tensors) -> [B], the real word embeddings e [B, n, d], (*inputs,
    *readout tensors), g(e) [B], the readout): the scalar being explained (`mixlens.targets`) as a function of the
    word embeddings. One plain forward at e gives g(e) and the output that 'pred' reads; with `grad`, e requires
    grad and g(e) keeps its graph (one forward and one backward give the gradient)."""
    keys = list(trace.inputs)
    kind = model_kind(trace.model)
    if isinstance(target, Request) and target.position is not None:  # resolved by explain: its own positions
        pos = torch.tensor(target.position, dtype=torch.long, device=trace.mask.device)
    else:
        pos = positions(kind, trace.inputs, trace.tokenizer, position).to(trace.mask.device)
    rows = LogitRows(trace, kind, target, pos)
    with torch.set_grad_enabled(grad):
        emb = trace.adapter.base.get_input_embeddings()(trace.inputs["input_ids"]).detach().requires_grad_(grad)
        out = _forward(trace, emb, trace.inputs, rows.kwargs(pos))
        _, ro = readout(trace.model, trace.tokenizer, out, trace.inputs, target, foil, position, rows.row_at(pos))
        value = ro.g(out, trace.inputs, row_at=rows.row_at(pos))

    def f(emb: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        inputs = dict(zip(keys, args[: len(keys)], strict=True))
        more = args[len(keys) :]  # index, foil, position, e0 (captum expands them with the inputs)
        at = more[2]
        return ro.g(_forward(trace, emb, inputs, rows.kwargs(at)), inputs, *more, row_at=rows.row_at(at))

    return f, emb, (*trace.inputs.values(), *ro.tensors()), value if grad else value.detach(), ro


def gradient(
    trace: Trace, target: Target = "pred", foil: int | None = None, position: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(∂g/∂e [B, n, d], the word embeddings e [B, n, d], g(e) [B]) for one target request: one forward and one
    backward pass per trace, kept in its memo, so that saliency, gradient × input (any reduction) and evaluate's
    agreement reference share them."""
    key = ("gradient", target, foil, position)
    memo = memo_of(trace)
    try:
        hit = memo.get(key)
        cacheable = True
    except TypeError:  # an unhashable Python target: computed each time
        hit, cacheable = None, False
    if hit is not None:
        return hit
    check_backward(trace, trace.mask.shape[0], "a gradient pass")
    with recomputed():  # the backward inside: it reruns the layers
        _, x, _, value, _ = scalar_fn(trace, target, foil, position, grad=True)  # one forward: 'pred' reads it
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(value.sum(), x)  # inputs are independent: row b of grad is ∂g_b/∂e
    out = (grad, x.detach(), value.detach())
    if cacheable:
        memo.put(key, out)
    return out


ROWS_PER_BACKWARD = 8  # requests whose gradients one batched backward computes (`row_gradients`)
ROW_PASSES: dict[str, Callable[[Trace, Sequence[Request]], None]] = {}  # method → its pass over many requests


def row_gradients(
    trace: Trace, requests: Sequence[Request], rules: AbstractContextManager[Any] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(∂g/∂e [1, n, d], e [1, n, d], g [1]) for each of several resolved requests on one input (a batch of one;
    e.g. the tokens of an answer): ONE forward pass (under `rules`, a context of gradient rules such as AttnLRP's)
    computing the logits at the requests' positions only, then one backward per request, `ROWS_PER_BACKWARD` of
    them batched into one vectorised backward (`is_grads_batched`; one by one where an operation refuses it). The
    requests stay separate scalars: nothing is summed across them."""
    if trace.mask.shape[0] != 1:
        raise MixlensError("row gradients take a batch of one input")
    check_backward(trace, 1, "a gradient pass")
    pos = torch.tensor([r.position[0] if r.position else -1 for r in requests], device=trace.mask.device)
    kept = torch.unique(pos)
    kwargs = {"logits_to_keep": kept} if keeps_logits(trace.model) and bool((pos >= 0).all()) else {}
    at = torch.searchsorted(kept, pos) if kwargs else None
    with torch.enable_grad():
        with rules if rules is not None else contextlib.nullcontext():
            emb = trace.adapter.base.get_input_embeddings()(trace.inputs["input_ids"]).detach().requires_grad_(True)
            out = _forward(trace, emb, trace.inputs, kwargs)
        readouts = [readout(trace.model, trace.tokenizer, out, trace.inputs, req)[1] for req in requests]
        values: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for s in range(0, len(requests), ROWS_PER_BACKWARD):
            chunk = range(s, min(s + ROWS_PER_BACKWARD, len(requests)))
            # each chunk reads its own logit rows (one slice of the kept logits) and its own scalars: reading every
            # request from the whole logits, or slicing all R scalars, would make each chunk's backward run through
            # all R readouts (zero gradients the size of the kept logits): R² work in all
            if at is not None and all(readouts[a].fn is None for a in chunk):
                rows, where = torch.unique(at[s : chunk.stop], return_inverse=True)
                view = SimpleNamespace(logits=out.logits[:, rows])  # [1, rows, V]
                part = torch.cat(
                    [readouts[a].g(view, trace.inputs, row_at=where[k : k + 1]) for k, a in enumerate(chunk)]
                )
            else:
                part = torch.cat(
                    [readouts[a].g(out, trace.inputs, row_at=None if at is None else at[a : a + 1]) for a in chunk]
                )
            values += [part[k : k + 1] for k in range(len(chunk))]
            try:
                eye = torch.eye(len(part), dtype=part.dtype, device=part.device)
                (batched,) = torch.autograd.grad(part, emb, grad_outputs=eye, is_grads_batched=True, retain_graph=True)
                grads += list(batched)  # [c, 1, n, d] → c × [1, n, d]
            except RuntimeError:  # an operation without a batching rule: one backward per request
                grads += [torch.autograd.grad(v, emb, retain_graph=True)[0] for v in part]
    x = emb.detach()
    return [(gr.detach(), x, v.detach()) for gr, v in zip(grads, values, strict=True)]


def gradient_rows(trace: Trace, methods: Sequence[str], requests: Sequence[Request]) -> None:
    """Run once, for all `requests` of a batch of one, the passes `methods` share (`ROW_PASSES`: the plain gradient
    of saliency and gradient × input, AttnLRP's modified one) and keep each request's result in the trace's memo,
    where the methods' own calls with that request find it."""
    for fn in dict.fromkeys(ROW_PASSES[m] for m in methods if m in ROW_PASSES):
        fn(trace, requests)


def recomputed() -> AbstractContextManager[Any]:
    """The context of a plain gradient pass: each layer recomputed in its backward (`trace.recomputed_layers`:
    the forward keeps every layer's input [B, n, d] only, the backward one layer's activations at a time; the
    gradient is the same) when `RECOMPUTE_LAYERS`."""
    return recomputed_layers() if RECOMPUTE_LAYERS else contextlib.nullcontext()


def _plain_rows(trace: Trace, requests: Sequence[Request]) -> None:
    memo = memo_of(trace)
    with recomputed():  # the backwards inside: they rerun the layers
        grads = row_gradients(trace, requests)
    for req, hit in zip(requests, grads, strict=True):
        memo.put(("gradient", req, None, None), hit)


ROW_PASSES.update(saliency=_plain_rows, grad_x_input=_plain_rows)


def check_backward(trace: Trace, rows: int, what: str) -> None:
    """MixlensError, in one line and before the pass, when a backward pass over `rows` inputs of the trace's
    length cannot fit the memory available (`memory.backward_bytes`)."""
    n = trace.mask.shape[1]
    d = trace.adapter.base.get_input_embeddings().embedding_dim
    need = backward_bytes(rows, n, trace.adapter.n_layers, d)
    check_fits(
        need,
        f"{what} on {rows} × {n} tokens (its backward keeps every layer's input and one layer's activations)",
        "use fewer or shorter inputs, or methods without gradients (explain: --method logit_attn or attention)",
        trace.mask.device,
    )


def reduce_hidden(raw: torch.Tensor, reduction: str, mask: torch.Tensor) -> torch.Tensor:
    """[B, n, d] → [B, n] by 'l2', 'l1' or 'sum' over d; padded tokens 0."""
    if reduction == "l2":
        v = raw.norm(dim=-1)
    elif reduction == "l1":
        v = raw.abs().sum(-1)
    else:
        v = raw.sum(-1)
    return v * mask.to(v.dtype)


def _chunk_rows(trace: Trace, steps: int, internal_batch_size: int | None) -> int:
    """Rows (input × step) per captum chunk: given, else ≈ IG_TOKENS_PER_CHUNK tokens and at least one batch."""
    if internal_batch_size is not None:  # checked by the registry (an integer ≥ 1)
        return internal_batch_size
    b, n = trace.mask.shape
    return ig_rows(b, n, steps)


def ig_rows(b: int, n: int, steps: int = 50) -> int:
    """Rows (input × step) of one default integrated-gradients chunk for `b` inputs of `n` tokens."""
    return min(b * steps, max(b, IG_TOKENS_PER_CHUNK // n // b * b))


def output_attribution(
    trace: Trace,
    kind: str = "saliency",
    *,
    target: Target = "pred",
    foil: int | None = None,
    position: int | None = None,
    reduction: str = "l2",
    baseline: str = "zero",
    steps: int = 50,
    internal_batch_size: int | None = None,
) -> OutputAttribution:
    """Attribute one scalar per input to its word embeddings; see the module docstring. Integrated gradients run the
    steps in chunks of `internal_batch_size` rows (input × step; default ≈ 2048 tokens), so memory stays bounded."""
    if kind not in KINDS:
        raise MixlensError(f"unknown saliency kind '{kind}'; valid: {', '.join(KINDS)}")
    ig = (
        {"baseline": baseline, "steps": steps, "internal_batch_size": internal_batch_size}
        if kind == "integrated_gradients"
        else {}
    )
    get(kind).check({"target": target, "foil": foil, "position": position, "reduction": reduction, **ig})
    if kind != "integrated_gradients":
        grad, x, value = gradient(trace, target, foil, position)
        raw = grad if kind == "saliency" else grad * x
        return OutputAttribution(reduce_hidden(raw, reduction, trace.mask), raw, value)
    chunk = _chunk_rows(trace, steps, internal_batch_size)
    check_backward(trace, chunk, "an integrated-gradients chunk")
    f, emb, args, value, _ = scalar_fn(trace, target, foil, position)
    from captum.attr import IntegratedGradients

    base = torch.zeros_like(emb)
    if baseline == "pad":
        pad_id = trace.model.config.pad_token_id
        if pad_id is None:
            raise MixlensError("baseline=pad needs a model with a pad token id")
        with torch.no_grad():
            base = trace.adapter.base.get_input_embeddings()(torch.full_like(trace.inputs["input_ids"], pad_id))
    with torch.enable_grad(), recomputed():  # each chunk's backward reruns the layers
        ig = IntegratedGradients(f).attribute(
            emb, baselines=base, additional_forward_args=args, n_steps=steps, internal_batch_size=chunk
        )
    raw = ig.detach()
    with torch.no_grad():
        base_value = f(base, *args)
    delta = raw.flatten(1).sum(1) - (value - base_value)  # captum's convergence delta, from f(x) computed once
    return OutputAttribution(reduce_hidden(raw, reduction, trace.mask), raw, value, base_value, delta)


TARGET = (
    *TARGET_OPTIONS,
    Option("reduction", str, "l2", choices=REDUCTIONS, help="over hidden dims: ‖·‖₂, ‖·‖₁ or the signed sum"),
)


@register(
    "saliency",
    options=TARGET,
    default_in={"saliency": 0},
    backward=True,
    **TARGET_SCORES,
    card=Card(
        definition="s_j = reduce_d ∂g/∂e_j (reduction l2 ‖·‖₂, l1 ‖·‖₁ or sum, the signed sum).",
        passes="One forward and one backward pass of its own per batch (LM head at the target position only).",
        memory="Every layer's input (layers · n · d floats) and one layer's activations at a time (each layer is "
        "recomputed in the backward); output [n].",
        official="captum `Saliency(abs=False)`",
        tolerance="asserted atol 1e-5, rtol 1e-3 (a benchmark, not a unit test)",
        check="benchmarks/bench_gradients_vs_captum.py",
        background=BACKGROUND,
    ),
)
def saliency(
    trace: Trace,
    *,
    target: Target = "pred",
    foil: int | None = None,
    position: int | None = None,
    reduction: str = "l2",
) -> torch.Tensor:
    """Gradient of a target scalar w.r.t. the word embeddings, reduced over hidden dims: [B, source]."""
    return output_attribution(
        trace, "saliency", target=target, foil=foil, position=position, reduction=reduction
    ).values


@register(
    "grad_x_input",
    options=TARGET,
    explain_options={"reduction": "sum"},  # explain reads the signed form
    reference=Reference("grad_x_input_l2", {"reduction": "l2"}),  # ‖∂g/∂e_j ⊙ e_j‖₂, the GlobEnc paper's reference
    backward=True,
    **TARGET_SCORES,
    card=Card(
        definition="s_j = reduce_d (∂g/∂e_j ⊙ e_j) (reduction l2, l1 or sum).",
        passes="One forward and one backward pass of its own per batch (LM head at the target position only).",
        memory="Every layer's input (layers · n · d floats) and one layer's activations at a time (each layer is "
        "recomputed in the backward); output [n].",
        official="inseq `input_x_gradient` (whole answers, SmolLM2-135M-Instruct; reduction sum = its `sum`, l2 = "
        "its `vnorm`); captum `InputXGradient`",
        tolerance="inseq: asserted ≤ 1e-5 of the largest |value| (measured 3.4e-6 signed sum, 4.2e-6 L2); captum: "
        "asserted atol 1e-5, rtol 1e-3",
        check="tests/explain/test_answers_vs_inseq.py::test_single_token_gradient_x_input_equals_inseq and "
        "::test_answer_gradient_x_input_equals_inseq (skipped unless MIXLENS_INSEQ_PYTHON names a Python with "
        "inseq); benchmarks/bench_gradients_vs_captum.py (captum)",
        background=BACKGROUND,
    ),
)
def grad_x_input(
    trace: Trace,
    *,
    target: Target = "pred",
    foil: int | None = None,
    position: int | None = None,
    reduction: str = "l2",
) -> torch.Tensor:
    """Gradient × word embedding for a target scalar, reduced over hidden dims: [B, source]."""
    return output_attribution(
        trace, "grad_x_input", target=target, foil=foil, position=position, reduction=reduction
    ).values


@register(
    "integrated_gradients",
    extras={"delta": ()},
    explain_options={"reduction": "sum"},  # explain reads the signed form
    backward=True,
    backward_rows=ig_rows,
    **TARGET_SCORES,
    options=(
        *TARGET,
        Option("baseline", str, "zero", choices=BASELINES, help="the embeddings integrated from: zeros or [PAD]s"),
        Option("steps", int, 50, min=2, max=MAX_STEPS, help="integration steps"),
        Option(
            "internal_batch_size",
            int,
            None,
            min=1,
            optional=True,
            help="input × step rows per captum chunk (default: about 2048 tokens), bounding memory",
        ),
    ),
    card=Card(
        definition="IG_j = reduce_d (e_j − b_j) ⊙ (1/m) Σ_k ∂g/∂e_j at b + (k/m)(e − b), m = steps, baseline b zero "
        "or [PAD] embeddings (captum's Gauss-Legendre points); extra delta = Σ_j IG_j − (g(e) − g(b)).",
        passes="steps forward + backward passes (in chunks of internal_batch_size rows), plus forwards at the input "
        "and the baseline.",
        memory="Every layer's input and one layer's activations of one chunk (about 2048 tokens by default; each layer "
        "is recomputed in the backward); output [n].",
        official="captum `IntegratedGradients` (mixlens runs it; compared on f(e) = the full-logit model's target "
        "logit)",
        tolerance="torch.testing.assert_close float32 defaults (rtol 1.3e-6, atol 1e-5); delta atol 1e-5",
        check="tests/methods/test_saliency.py::test_lm_logits_only_at_target",
        background=BACKGROUND,
    ),
)
def integrated_gradients(
    trace: Trace,
    *,
    target: Target = "pred",
    foil: int | None = None,
    position: int | None = None,
    reduction: str = "l2",
    baseline: str = "zero",
    steps: int = 50,
    internal_batch_size: int | None = None,
) -> MethodOutput:
    """Integrated gradients (captum) at the word embeddings for a target scalar, the steps run in chunks of
    `internal_batch_size` input × step rows (default ≈ 2048 tokens): [B, source].

    Extra `delta` [B]: captum's convergence delta."""
    res = output_attribution(
        trace,
        "integrated_gradients",
        target=target,
        foil=foil,
        position=position,
        reduction=reduction,
        baseline=baseline,
        steps=steps,
        internal_batch_size=internal_batch_size,
    )
    assert res.delta is not None  # integrated gradients report it
    return MethodOutput(res.values, {"delta": res.delta})
