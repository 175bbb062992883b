"""Output saliency for one scalar per input (DESIGN §3.7): gradient, gradient × input, integrated gradients.

The scalar f is a class logit (sequence classifier), a token's logit at one position (masked LM: the [MASK];
causal LM: the last token), or any function `target(model_output, inputs) -> [B]` given in Python. Attribution is
at the word-embedding output e_j (the engine's edit point `embed` replaces it, so position embeddings and
LayerNorm are applied exactly once), reduced over hidden dims: ‖·‖₂ (default), ‖·‖₁ or the signed sum. Integrated
gradients come from captum; with reduction='sum' they satisfy Σ_j IG_j ≈ f(x) − f(baseline) up to captum's
convergence delta Σ_j IG_j − (f(x) − f(baseline)). An LM target's logits are computed at its position only.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mixlens.errors import MixlensError
from mixlens.methods.registry import MethodOutput, Option, get, register
from mixlens.trace import Trace, hooked

REDUCTIONS = ("l2", "l1", "sum")
KINDS = ("saliency", "grad_x_input", "integrated_gradients")
BASELINES = ("zero", "pad")
IG_TOKENS_PER_CHUNK = 2048  # default tokens per integrated-gradients chunk (input × step rows × tokens)
Target = int | str | Callable[..., torch.Tensor]


@dataclass
class OutputAttribution:
    """Per-token scores [B, n] (padding 0), the raw per-dimension attribution [B, n, d], the target value
    f(x) [B], and for integrated gradients f(baseline) [B] and captum's convergence delta [B]."""

    values: torch.Tensor
    raw: torch.Tensor
    target_value: torch.Tensor
    baseline_value: torch.Tensor | None = None
    delta: torch.Tensor | None = None


def _positions(trace: Trace, position: int | None) -> torch.Tensor:
    """Target position per input [B]: given, else the first [MASK], else (causal models) the last real token."""
    b = trace.mask.shape[0]
    lengths = trace.mask.sum(-1)
    if position is not None:
        if position >= int(lengths.min()):
            raise MixlensError(f"position must be a token index below {int(lengths.min())}, got {position!r}")
        return torch.full((b,), position, dtype=torch.long)
    mask_id = getattr(trace.tokenizer, "mask_token_id", None)
    if mask_id is not None:
        hits = trace.inputs["input_ids"].cpu() == mask_id
        if hits.any(-1).all():
            return hits.int().argmax(-1)
    if trace.adapter.family.causal:
        return lengths.cpu() - 1
    raise MixlensError("no [MASK] token in every input; mark one with the tokenizer's mask token or give position")


def _check_target(target: Target) -> None:
    if not (callable(target) or target == "pred" or (isinstance(target, int) and not isinstance(target, bool))):
        raise MixlensError(f"target must be 'pred', a class/token index or a Python callable, got {target!r}")


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
    union of the batch's positions (`kept` [K]). Any other model (or a Python callable target) computes all.
    `at` [B]: each input's target position (each), its index among `kept`, or None (decided from the logits)."""

    def __init__(self, trace: Trace, target: Target, position: int | None):
        self.each, self.kept, self.at = False, None, None
        model = trace.model
        if callable(target) or model.get_output_embeddings() is None:
            return
        if not keeps_logits(model):
            return
        pos = _positions(trace, position).to(trace.mask.device)
        if per_row_keep(model):
            self.each, self.at = True, pos
        else:
            self.kept, self.at = torch.unique(pos, return_inverse=True)

    def kwargs(self, at: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The model call's keyword arguments for rows whose targets are `at` [R] (None: not an LM target)."""
        if self.each and at is not None:
            return {"logits_to_keep": at[:, None]}
        return {} if self.kept is None else {"logits_to_keep": self.kept}

    def index(self, at: torch.Tensor) -> torch.Tensor:
        """Each row's index [R] on the position axis of the logits computed with `kwargs(at)`."""
        return torch.zeros_like(at) if self.each else at


def _selector(
    trace: Trace, target: Target, position: int | None, logits: torch.Tensor | None, rows: LogitRows
) -> tuple[Callable, tuple[torch.Tensor, ...]]:
    """(select(output, inputs, *extra) -> [B], extra per-input tensors); extra rows travel with captum's batch (for
    an LM target the first is `at`, see `LogitRows`). `logits`: the model's output at the real inputs, computed with
    `rows.kwargs(rows.at)` ([B, classes] or [B, positions, vocab]), which 'pred' reads."""
    _check_target(target)
    if callable(target):
        return (lambda out, inputs: target(out, inputs)), ()
    if logits is None:
        raise MixlensError(
            "this model has no output head; load it with a head (e.g. --head sequence-classification) "
            "or pass a Python callable as target"
        )
    dev = logits.device
    if logits.dim() == 2:  # [B, classes]
        if isinstance(target, int) and not 0 <= target < logits.shape[-1]:
            raise MixlensError(f"class {target} out of range; the model has {logits.shape[-1]} classes")
        cls = torch.full((logits.shape[0],), target, device=dev) if isinstance(target, int) else logits.argmax(-1)
        return (lambda out, inputs, c: out.logits.gather(1, c[:, None])[:, 0]), (cls,)
    at = rows.at if rows.at is not None else _positions(trace, position).to(dev)  # [B, positions, vocab]
    target_rows = logits[torch.arange(logits.shape[0], device=dev), rows.index(at)]
    if isinstance(target, int) and not 0 <= target < target_rows.shape[-1]:
        raise MixlensError(f"token id {target} out of range; the vocabulary has {target_rows.shape[-1]} entries")
    tok = torch.full((logits.shape[0],), target, device=dev) if isinstance(target, int) else target_rows.argmax(-1)

    def pick(out, inputs, a, t):
        return out.logits[torch.arange(a.shape[0], device=a.device), rows.index(a), t]

    return pick, (at, tok)


def _forward(trace: Trace, emb: torch.Tensor, inputs: dict[str, torch.Tensor], kwargs: dict[str, torch.Tensor]):
    """The model's output with the word embeddings replaced by `emb` [B, n, d] (edit point `embed`, no capture)."""
    with hooked(trace.adapter, {"embed": lambda _: emb}):
        return trace.model(**inputs, **kwargs)


def _evaluate(
    trace: Trace, emb: torch.Tensor, target: Target, position: int | None, rows: LogitRows
) -> tuple[Callable, tuple[torch.Tensor, ...], torch.Tensor]:
    """One forward at the word embeddings `emb`: (select, extra, f(emb) [B]) of `_selector`, 'pred' read from this
    forward's logits (only the rows of `rows` are computed)."""
    out = _forward(trace, emb, trace.inputs, rows.kwargs(rows.at))
    logits = getattr(out, "logits", None)
    select, extra = _selector(trace, target, position, None if logits is None else logits.detach(), rows)
    return select, extra, select(out, trace.inputs, *extra)


def scalar_fn(
    trace: Trace, target: Target = "pred", position: int | None = None
) -> tuple[Callable[..., torch.Tensor], torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """(f(emb [B, n, d], *inputs, *extra) -> [B], the real word embeddings e [B, n, d], (*inputs, *extra), f(e) [B]).
    One plain forward at e gives f(e) and the logits that 'pred' reads."""
    keys = list(trace.inputs)
    _check_target(target)
    rows = LogitRows(trace, target, position)
    with torch.no_grad():
        emb = trace.adapter.base.get_input_embeddings()(trace.inputs["input_ids"])
        select, extra, value = _evaluate(trace, emb, target, position, rows)

    def f(emb: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        inputs = dict(zip(keys, args[: len(keys)], strict=True))
        more = args[len(keys) :]
        return select(_forward(trace, emb, inputs, rows.kwargs(more[0] if more else None)), inputs, *more)

    return f, emb, (*trace.inputs.values(), *extra), value


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
    return min(b * steps, max(b, IG_TOKENS_PER_CHUNK // n // b * b))


def output_attribution(
    trace: Trace,
    kind: str = "saliency",
    *,
    target: Target = "pred",
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
    get(kind).check({"target": target, "position": position, "reduction": reduction, **ig})  # declared options
    if kind != "integrated_gradients":
        _check_target(target)
        rows = LogitRows(trace, target, position)
        with torch.enable_grad():
            x = trace.adapter.base.get_input_embeddings()(trace.inputs["input_ids"]).detach().requires_grad_(True)
            _, _, value = _evaluate(trace, x, target, position, rows)  # one forward: 'pred' reads its logits
            (grad,) = torch.autograd.grad(value.sum(), x)  # inputs are independent: row b of grad is ∂f_b/∂e
        raw = grad if kind == "saliency" else grad * x.detach()
        return OutputAttribution(reduce_hidden(raw, reduction, trace.mask), raw, value.detach())
    chunk = _chunk_rows(trace, steps, internal_batch_size)
    f, emb, args, value = scalar_fn(trace, target, position)
    from captum.attr import IntegratedGradients

    base = torch.zeros_like(emb)
    if baseline == "pad":
        pad_id = trace.model.config.pad_token_id
        if pad_id is None:
            raise MixlensError("baseline=pad needs a model with a pad token id")
        with torch.no_grad():
            base = trace.adapter.base.get_input_embeddings()(torch.full_like(trace.inputs["input_ids"], pad_id))
    with torch.enable_grad():
        ig = IntegratedGradients(f).attribute(
            emb, baselines=base, additional_forward_args=args, n_steps=steps, internal_batch_size=chunk
        )
    raw = ig.detach()
    with torch.no_grad():
        base_value = f(base, *args)
    delta = raw.flatten(1).sum(1) - (value - base_value)  # captum's convergence delta, from f(x) computed once
    return OutputAttribution(reduce_hidden(raw, reduction, trace.mask), raw, value, base_value, delta)


TARGET = (
    Option(
        "target",
        int,
        "pred",
        min=0,
        words=("pred",),
        python_callable=True,
        help="class index / token id of the scalar, 'pred' (the predicted one) or (Python) f(output, inputs)",
    ),
    Option(
        "position",
        int,
        None,
        min=0,
        optional=True,
        help="token position of an LM target (default: the [MASK], or the last token of a causal LM)",
    ),
    Option("reduction", str, "l2", choices=REDUCTIONS, help="over hidden dims: ‖·‖₂, ‖·‖₁ or the signed sum"),
)


@register("saliency", dims=("source",), extra_passes=True, options=TARGET)
def saliency(
    trace: Trace, *, target: Target = "pred", position: int | None = None, reduction: str = "l2"
) -> torch.Tensor:
    """Gradient of a target scalar w.r.t. the word embeddings, reduced over hidden dims: [B, source]."""
    return output_attribution(trace, "saliency", target=target, position=position, reduction=reduction).values


@register("grad_x_input", dims=("source",), extra_passes=True, options=TARGET)
def grad_x_input(
    trace: Trace, *, target: Target = "pred", position: int | None = None, reduction: str = "l2"
) -> torch.Tensor:
    """Gradient × word embedding for a target scalar, reduced over hidden dims: [B, source]."""
    return output_attribution(trace, "grad_x_input", target=target, position=position, reduction=reduction).values


@register(
    "integrated_gradients",
    dims=("source",),
    extra_passes=True,
    extras={"delta": ()},
    options=(
        *TARGET,
        Option("baseline", str, "zero", choices=BASELINES, help="the embeddings integrated from: zeros or [PAD]s"),
        Option("steps", int, 50, min=2, help="integration steps"),
        Option(
            "internal_batch_size",
            int,
            None,
            min=1,
            optional=True,
            help="input × step rows per captum chunk (default: about 2048 tokens), bounding memory",
        ),
    ),
)
def integrated_gradients(
    trace: Trace,
    *,
    target: Target = "pred",
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
        position=position,
        reduction=reduction,
        baseline=baseline,
        steps=steps,
        internal_batch_size=internal_batch_size,
    )
    assert res.delta is not None  # integrated gradients report it
    return MethodOutput(res.values, {"delta": res.delta})
