"""Captum's perturbation and reference-based attributions of the scalar being explained (`mixlens.targets`).

All act on the word embeddings e_j (the edit point `embed`, as the gradient methods of `saliency`), with a zero
baseline, and give one signed score per token [B, source] (padding 0):

- `occlusion`: g(x) − g(x with e_j zeroed), one token at a time (captum `Occlusion`, window = one token);
- `deeplift` (captum `DeepLift`): its rescale rule applies only at the nonlinear *modules* it knows, e.g. the
  pooler's tanh; GELU/SiLU, LayerNorm and the functional softmax of attention fall back to the gradient, so on
  Transformers it is DeepLIFT-rescale at those modules and gradient × Δinput elsewhere;
- `gradient_shap`: expected gradients from the zero and the pad/mask-token baselines, `samples` seeded samples;
- `lime`: `samples` seeded samples of token subsets, exponential kernel on cosine distance, closed-form weighted
  ridge (λ = 1).

Perturbations run in chunks of at most `token_budget(model)` tokens, so memory stays flat on long inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixlens.methods.registry import TARGET_OPTIONS, TARGET_SCORES, Card, Option, register
from mixlens.methods.saliency import Target, scalar_fn
from mixlens.targets import model_kind
from mixlens.trace import Trace

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("answers.md", "the scalar each method explains")

MAX_SHAP_SAMPLES = 1024  # expected-gradient samples (chunked: memory flat; time grows with them)
MAX_LIME_SAMPLES = 10_000  # LIME keeps every sample's subset and output for its ridge fit

TOKEN_BUDGET = 4096  # at most this many tokens per forward pass of the perturbations
ACTIVATION_FLOATS = 1 << 28  # and about this many floats kept for the backward pass (1 GiB in float32)
SEED = Option("seed", int, 0, help="seed of the samples")


def token_budget(model: Any) -> int:  # a transformers model
    """Tokens per chunk of perturbations: `TOKEN_BUDGET`, fewer for large models, so that the activations kept for
    the backward pass (about 24·d floats per layer and token, plus the logits and their gradient of an LM's
    vocabulary) stay near `ACTIVATION_FLOATS`."""
    cfg = model.config
    d = int(getattr(cfg, "hidden_size", 0) or model.get_input_embeddings().embedding_dim)
    layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0) if model_kind(model) in ("causal", "masked") else 0
    return max(64, min(TOKEN_BUDGET, ACTIVATION_FLOATS // (24 * d * layers + 2 * vocab)))


class _Scalar(nn.Module):
    """g(word embeddings, *args) as a module that owns the model (captum's DeepLift hooks the model's submodules)."""

    def __init__(self, model: nn.Module, g: Any):
        super().__init__()
        self.model, self.g = model, g

    def forward(self, emb: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        return self.g(emb, *args)


def _prepare(
    trace: Trace, target: Target, foil: int | None, position: int | None
) -> tuple[_Scalar, torch.Tensor, tuple[torch.Tensor, ...]]:
    g, emb, args, _, _ = scalar_fn(trace, target, foil, position)
    return _Scalar(trace.model, g), emb, args


def _masked(trace: Trace, scores: torch.Tensor) -> torch.Tensor:
    return scores.detach().float() * trace.mask.to(torch.float32)


@register(
    "occlusion",
    options=TARGET_OPTIONS,
    **TARGET_SCORES,
    card=Card(
        definition="s_j = g(e) − g(e with e_j = 0), one token at a time (captum `Occlusion`, window one token, run "
        "by mixlens).",
        passes="n + 1 forward passes per input, no backward, in chunks of at most 4096 tokens.",
        memory="One chunk's forward activations; output [n].",
        note="captum's `Occlusion` computes it (mixlens supplies the scalar and the chunks); not compared separately",
        background=BACKGROUND,
    ),
)
def occlusion(trace: Trace, *, target: Target = "pred", foil: int | None = None, position: int | None = None):
    """Occlusion (captum): the drop of the explained scalar when one token's word embedding is zeroed."""
    from captum.attr import Occlusion

    f, emb, args = _prepare(trace, target, foil, position)
    per = max(1, token_budget(trace.model) // (emb.shape[1] * emb.shape[0]))
    with torch.no_grad():
        a = Occlusion(f).attribute(
            emb,
            sliding_window_shapes=(1, emb.shape[-1]),
            baselines=0.0,
            additional_forward_args=args,
            perturbations_per_eval=per,
        )
    return _masked(trace, a.mean(-1))  # each window's Δg is written to every element of the window


@register(
    "deeplift",
    options=TARGET_OPTIONS,
    backward=True,
    backward_rows=lambda b, n: 2 * b,  # each input with its baseline
    **TARGET_SCORES,
    card=Card(
        definition="DeepLIFT-rescale (captum `DeepLift`, run by mixlens) from zero word embeddings, summed over "
        "hidden dims; the rule applies at the modules captum knows, the gradient elsewhere.",
        passes="One forward (input and baseline) and one backward pass per batch.",
        memory="The activations of one backward pass; output [n].",
        note="captum's `DeepLift` computes it; not compared separately",
        background=BACKGROUND,
    ),
)
def deeplift(trace: Trace, *, target: Target = "pred", foil: int | None = None, position: int | None = None):
    """DeepLift (captum) from zero word embeddings, summed over hidden dims (see the module docstring)."""
    from captum.attr import DeepLift

    f, emb, args = _prepare(trace, target, foil, position)
    with torch.enable_grad():
        a = DeepLift(f).attribute(emb, baselines=torch.zeros_like(emb), additional_forward_args=args)
    return _masked(trace, a.sum(-1))


@register(
    "gradient_shap",
    options=(
        *TARGET_OPTIONS,
        Option("samples", int, 16, min=1, max=MAX_SHAP_SAMPLES, help="samples of expected gradients"),
        SEED,
    ),
    backward=True,
    **TARGET_SCORES,
    card=Card(
        definition="Expected gradients (captum `GradientShap`, run by mixlens) from the zero and the pad/mask-token "
        "embeddings, samples seeded draws.",
        passes="samples forward + backward passes, in chunks.",
        memory="One chunk's activations; output [n].",
        note="captum's `GradientShap` computes it, in chunks of samples; not compared separately",
        background=BACKGROUND,
    ),
)
def gradient_shap(
    trace: Trace,
    *,
    target: Target = "pred",
    foil: int | None = None,
    position: int | None = None,
    samples: int = 16,
    seed: int = 0,
):
    """GradientSHAP (captum): expected gradients from the zero and the pad/mask-token word embeddings."""
    from captum.attr import GradientShap

    f, emb, args = _prepare(trace, target, foil, position)
    tok = trace.tokenizer
    base_id = getattr(tok, "mask_token_id", None)
    base_id = base_id if base_id is not None else getattr(tok, "pad_token_id", None)
    bases = [torch.zeros_like(emb[:1])]
    embed = trace.adapter.base.get_input_embeddings()
    if base_id is not None:
        with torch.no_grad():
            bases.append(embed(torch.full_like(trace.inputs["input_ids"][:1], base_id)))
    torch.manual_seed(seed)
    per = max(1, token_budget(trace.model) // (emb.shape[0] * emb.shape[1]))
    total, done = torch.zeros(emb.shape[:2], device=emb.device), 0
    with torch.enable_grad():
        while done < samples:  # captum evaluates all samples at once; chunks keep memory flat
            k = min(per, samples - done)
            a = GradientShap(f).attribute(
                emb, baselines=torch.cat(bases), n_samples=k, stdevs=0.0, additional_forward_args=args
            )
            total += a.sum(-1).detach() * k
            done += k
    return _masked(trace, total / samples)


@register(
    "lime",
    options=(
        *TARGET_OPTIONS,
        Option("samples", int, 100, min=2, max=MAX_LIME_SAMPLES, help="sampled token subsets per input"),
        SEED,
    ),
    **TARGET_SCORES,
    card=Card(
        definition="Weighted ridge fit (λ = 1) of g on samples seeded token subsets, exponential kernel on cosine "
        "distance (captum `Lime`, run by mixlens, one input at a time).",
        passes="samples forward passes per input, no backward, in chunks.",
        memory="Every sample's subset and output ([samples, n]); output [n].",
        note="captum's `Lime` computes it (mixlens supplies the closed-form ridge); not compared separately",
        background=BACKGROUND,
    ),
)
def lime(
    trace: Trace,
    *,
    target: Target = "pred",
    foil: int | None = None,
    position: int | None = None,
    samples: int = 100,
    seed: int = 0,
):
    """LIME (captum): a weighted ridge fit of the explained scalar on sampled token subsets."""
    from captum.attr import Lime
    from captum.attr._core.lime import get_exp_kernel_similarity_function

    f, emb, args = _prepare(trace, target, foil, position)
    keys = len(trace.inputs)
    mask = trace.mask
    out = torch.zeros(emb.shape[:2])
    budget = token_budget(trace.model)
    explainer = Lime(f, interpretable_model=_Ridge(), similarity_func=get_exp_kernel_similarity_function("cosine"))
    for b in range(emb.shape[0]):  # captum's Lime explains one input at a time
        n = int(mask[b].sum())
        one = tuple(a[b : b + 1, :n] if k < keys else a[b : b + 1] for k, a in enumerate(args))  # inputs: [B, n]
        fm = torch.arange(n, device=emb.device)[None, :, None].expand(1, n, emb.shape[-1])
        torch.manual_seed(seed)
        a = explainer.attribute(
            emb[b : b + 1, :n],
            baselines=0.0,
            additional_forward_args=one,
            feature_mask=fm,
            n_samples=samples,
            perturbations_per_eval=max(1, budget // n),
        )
        out[b, :n] = a[0, :, 0].detach().float().cpu()  # every hidden dim of a token carries the token's weight
    return out.to(mask.device)


class _Ridge:
    """Closed-form weighted ridge regression (λ = 1, intercept unpenalised) as captum's interpretable model."""

    def __init__(self, lam: float = 1.0):
        self.lam, self.coef = lam, torch.zeros(0)

    def fit(self, train_data: Any, **kwargs: Any) -> None:
        xs, ys, ws = zip(*[(x, y, w) for x, y, w in train_data], strict=True)
        x, y, w = torch.cat(xs).double(), torch.cat(ys).double().reshape(-1), torch.cat(ws).double().reshape(-1)
        x1 = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
        reg = torch.eye(x1.shape[1], dtype=x.dtype) * self.lam
        reg[-1, -1] = 0
        xtw = x1.T * w
        self.coef = torch.linalg.solve(xtw @ x1 + reg, xtw @ y)[:-1].float()

    def representation(self) -> torch.Tensor:
        return self.coef[None]
