"""One score per source token for a target (`targets.Target`), for every applicable method.

- `decompx_classes` (classifiers: the target class row, minus the foil row for a contrast) and `decompx_logit`
  (causal LMs: the target logit through the unembedding): signed, and summing exactly to the explained score;
- the gradient family at the word embeddings e_j for the attribution score g (see `targets`): `saliency`
  ‖∂g/∂e_j‖₂, `grad_x_input` Σ_d ∂g/∂e_j ⊙ e_j (signed), `integrated_gradients` (zero baseline, 50 steps, signed);
- the map methods of the registry, the target row of their last layer: [CLS] for classifier encoders, the mean of
  the rows for mean-pooled encoders, the last real token for decoders;
- through captum, at the word embeddings with a zero baseline, signed sums over hidden dims: `occlusion` (one token
  at a time), `deeplift` (captum DeepLift: its rescale rule applies only at the nonlinear *modules* it knows,
  e.g. the pooler's tanh; GELU/SiLU, LayerNorm and the functional softmax of attention fall back to the gradient,
  so on Transformers it is DeepLIFT-rescale at those modules and gradient × Δinput elsewhere), `gradient_shap`
  (expected gradients from the zero and the pad/mask-token baselines, 16 samples, seeded) and `lime` (100 seeded
  samples of token subsets, exponential kernel on cosine distance, closed-form weighted ridge).

Every captum method evaluates its perturbations in chunks of at most `token_budget(model)` tokens, so memory stays flat
on long inputs. All outputs are [B, n] with padding 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixlens.errors import MixlensError
from mixlens.explain.targets import Readout, scores

if TYPE_CHECKING:
    from mixlens.methods.registry import Method

MAPS = (
    "attention",
    "attention_rollout",
    "norm_rollout",
    "norm_res_rollout",
    "norm_resln_rollout",
    "globenc_rollout",
    "alti_rollout",
    "value_zeroing_rollout",
    "hta",
)
GRADIENT = ("saliency", "grad_x_input", "integrated_gradients")
CAPTUM = ("occlusion", "deeplift", "gradient_shap", "lime")
SLOW = ("hta",)  # exact forward-mode Jacobians: n·d JVPs per input; left out of the default set
REFERENCE = "grad_x_input_l2"  # ‖∂g/∂e_j ⊙ e_j‖₂, the agreement reference of the GlobEnc paper
TOKEN_BUDGET = 4096  # at most this many tokens per forward pass of a captum method's perturbations
ACTIVATION_FLOATS = 1 << 28  # and about this many floats kept for the backward pass (1 GiB in float32)
IG_STEPS = 50
SHAP_SAMPLES = 16
LIME_SAMPLES = 100


def token_budget(model: Any) -> int:  # a transformers model
    """Tokens per chunk of perturbations: `TOKEN_BUDGET`, fewer for large models, so that the activations kept for
    the backward pass (about 24·d floats per layer and token, plus the logits and their gradient of a causal LM's
    vocabulary) stay near `ACTIVATION_FLOATS`."""
    from mixlens.explain.targets import model_kind

    cfg = model.config
    d = int(getattr(cfg, "hidden_size", 0) or model.get_input_embeddings().embedding_dim)
    layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0) if model_kind(model) == "causal" else 0
    return max(64, min(TOKEN_BUDGET, ACTIVATION_FLOATS // (24 * d * layers + 2 * vocab)))


def applicable(kind: str) -> list[str]:
    """Every method that explains a target of this model kind."""
    own = {"classifier": ["decompx_classes"], "causal": ["decompx_logit"], "encoder": []}[kind]
    return own + list(GRADIENT) + list(CAPTUM) + list(MAPS)


def default_methods(kind: str) -> list[str]:
    return [m for m in applicable(kind) if m not in SLOW]


def check_methods(kind: str, methods: list[str]) -> list[str]:
    ok = applicable(kind)
    for m in methods:
        if m not in ok:
            raise MixlensError(f"method '{m}' does not explain a {kind} target; valid: {', '.join(ok)}")
    return list(dict.fromkeys(methods))


class _Scalar(nn.Module):
    """g(word embeddings) as a module (captum's DeepLift hooks the model's submodules)."""

    def __init__(self, model: nn.Module, ro: Readout, has_tti: bool):
        super().__init__()
        self.model, self.kind, self.pool, self.has_tti = model, ro.kind, ro.pool, has_tti

    def forward(
        self,
        emb: torch.Tensor,
        mask: torch.Tensor,
        index: torch.Tensor,
        foil: torch.Tensor,
        e0: torch.Tensor,
        *tti: torch.Tensor,
    ) -> torch.Tensor:
        extra = {"token_type_ids": tti[0]} if self.has_tti else {}
        out = self.model(inputs_embeds=emb, attention_mask=mask, **extra)
        return scores(self.kind, self.pool, out, mask, index, foil, e0)[0]


def _args(inputs: dict[str, torch.Tensor], ro: Readout) -> tuple[torch.Tensor, ...]:
    tti = (inputs["token_type_ids"],) if "token_type_ids" in inputs else ()
    return (inputs["attention_mask"], *ro.tensors(), *tti)


def _row(values: torch.Tensor, mask: torch.Tensor, ro: Readout, causal: bool) -> torch.Tensor:
    """values [B, layer, target, source] → the target row of the last layer [B, source]."""
    last = values[:, -1]
    if ro.kind == "encoder" and ro.pool == "mean":
        m = mask.to(last.dtype)
        return (last * m[:, :, None]).sum(1) / m.sum(1, keepdim=True)
    pos = mask.long().sum(-1) - 1 if causal else torch.zeros(mask.shape[0], dtype=torch.long)
    return last[torch.arange(last.shape[0]), pos]


def attribute(
    lens,
    inputs: dict[str, torch.Tensor],
    ro: Readout,
    methods: list[str],
    *,
    seed: int = 0,
    reference: bool = False,
    timings: dict[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """Scores [B, n] (padding 0) of each method for the batch `inputs` and its targets `ro`; with `reference`
    also `REFERENCE`. `timings` accumulates seconds per method."""
    from mixlens.methods import get

    model = lens.model
    mask = inputs["attention_mask"]
    fmask = mask.to(torch.float32).cpu()
    out: dict[str, torch.Tensor] = {}
    timings = timings if timings is not None else {}

    def timed(name: str, fn: Callable[[], torch.Tensor]) -> None:
        t0 = time.perf_counter()
        out[name] = fn().detach().float().cpu() * fmask
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0

    with torch.no_grad():
        emb = model.get_input_embeddings()(inputs["input_ids"])
    scalar = _Scalar(model, ro, "token_type_ids" in inputs)
    args = _args(inputs, ro)
    n = mask.shape[1]
    budget = token_budget(model)

    if {"saliency", "grad_x_input"} & set(methods) or reference:
        t0 = time.perf_counter()
        with torch.enable_grad():
            x = emb.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(scalar(x, *args).sum(), x)  # rows are independent: row b = ∂g_b/∂e
        spent = time.perf_counter() - t0
        grads = {"saliency": grad.norm(dim=-1), "grad_x_input": (grad * emb).sum(-1)}
        for name in ("saliency", "grad_x_input"):
            if name in methods:
                timed(name, partial(grads.__getitem__, name))
                timings[name] += spent / max(1, len({"saliency", "grad_x_input"} & set(methods)))
        if reference:
            out[REFERENCE] = (grad * emb).norm(dim=-1).detach().cpu() * fmask
    if "integrated_gradients" in methods:
        from captum.attr import IntegratedGradients

        def ig() -> torch.Tensor:
            a = IntegratedGradients(scalar).attribute(
                emb,
                baselines=torch.zeros_like(emb),
                additional_forward_args=args,
                n_steps=IG_STEPS,
                internal_batch_size=max(1, budget // n),
            )
            return a.sum(-1)

        timed("integrated_gradients", ig)
    if "occlusion" in methods:
        from captum.attr import Occlusion

        def occ() -> torch.Tensor:
            per = max(1, budget // (n * emb.shape[0]))
            with torch.no_grad():
                a = Occlusion(scalar).attribute(
                    emb,
                    sliding_window_shapes=(1, emb.shape[-1]),
                    baselines=0.0,
                    additional_forward_args=args,
                    perturbations_per_eval=per,
                )
            return a.mean(-1)  # each window's Δg is written to every element of the window

        timed("occlusion", occ)
    if "deeplift" in methods:
        from captum.attr import DeepLift

        timed(
            "deeplift",
            lambda: (
                DeepLift(scalar).attribute(emb, baselines=torch.zeros_like(emb), additional_forward_args=args).sum(-1)
            ),
        )
    if "gradient_shap" in methods:
        timed("gradient_shap", lambda: _gradient_shap(lens, scalar, emb, args, seed))
    if "lime" in methods:
        timed("lime", lambda: _lime(scalar, emb, args, mask, seed, budget))
    maps = [m for m in methods if m in MAPS or m.startswith("decompx")]
    if maps:
        specs = {m: get(m) for m in maps}
        t0 = time.perf_counter()
        tr = lens.trace(_encoded(inputs), ffn=any(s.needs_ffn for s in specs.values()))
        shared = (time.perf_counter() - t0) / len(maps)
        for m, spec in specs.items():
            if m == "decompx_classes":

                def dec(spec: Method = spec) -> torch.Tensor:
                    c = spec(tr)  # [B, C, n]
                    rows = c[torch.arange(c.shape[0]), ro.index]
                    return rows - torch.where(
                        ro.foil[:, None] >= 0, c[torch.arange(c.shape[0]), ro.foil.clamp_min(0)], 0.0
                    )

                timed(m, dec)
            elif m == "decompx_logit":
                from mixlens.methods.decompx_logit import logit_scores

                timed(m, lambda: logit_scores(tr, ro.index, ro.foil))
            else:

                def row(spec: Method = spec) -> torch.Tensor:
                    return _row(spec(tr).float().cpu(), mask.cpu(), ro, lens.adapter.family.causal)

                timed(m, row)
            timings[m] += shared
    return {m: out[m] for m in [*methods, *([REFERENCE] if reference else [])]}


def _encoded(inputs: dict[str, torch.Tensor]):
    """An `Encoded` for `lens.trace` from model inputs (token strings are not needed by the methods)."""
    from mixlens.lens import Encoded

    return Encoded(inputs, [], [], [])


def _gradient_shap(
    lens, scalar: nn.Module, emb: torch.Tensor, args: tuple[torch.Tensor, ...], seed: int
) -> torch.Tensor:
    from captum.attr import GradientShap

    tok = lens.tokenizer
    base_id = tok.mask_token_id if tok.mask_token_id is not None else tok.pad_token_id
    bases = [torch.zeros_like(emb[:1])]
    if base_id is not None:
        with torch.no_grad():
            bases.append(lens.model.get_input_embeddings()(torch.full_like(args[0][:1], base_id)))
    torch.manual_seed(seed)
    per = max(1, token_budget(lens.model) // (emb.shape[0] * emb.shape[1]))
    total, done = torch.zeros(emb.shape[:2]), 0
    while done < SHAP_SAMPLES:  # captum evaluates all samples at once; chunks keep memory flat
        k = min(per, SHAP_SAMPLES - done)
        a = GradientShap(scalar).attribute(
            emb, baselines=torch.cat(bases), n_samples=k, stdevs=0.0, additional_forward_args=args
        )
        total += a.sum(-1).detach().cpu() * k
        done += k
    return total / SHAP_SAMPLES


def _lime(
    scalar: nn.Module, emb: torch.Tensor, args: tuple[torch.Tensor, ...], mask: torch.Tensor, seed: int, budget: int
) -> torch.Tensor:
    from captum.attr import Lime
    from captum.attr._core.lime import get_exp_kernel_similarity_function

    out = torch.zeros(emb.shape[:2])
    lime = Lime(scalar, interpretable_model=_Ridge(), similarity_func=get_exp_kernel_similarity_function("cosine"))
    for b in range(emb.shape[0]):  # captum's Lime explains one input at a time
        n = int(mask[b].sum())
        one = tuple(a[b : b + 1, :n] if k in (0, 4) else a[b : b + 1] for k, a in enumerate(args))  # see _args
        fm = torch.arange(n)[None, :, None].expand(1, n, emb.shape[-1])
        torch.manual_seed(seed)
        a = lime.attribute(
            emb[b : b + 1, :n],
            baselines=0.0,
            additional_forward_args=one,
            feature_mask=fm,
            n_samples=LIME_SAMPLES,
            perturbations_per_eval=max(1, budget // n),
        )
        out[b, :n] = a[0, :, 0].detach().cpu()  # every hidden dim of a token carries the token's weight
    return out


class _Ridge:
    """Closed-form weighted ridge regression (λ = 1, intercept unpenalised) as captum's interpretable model."""

    def __init__(self, lam: float = 1.0):
        self.lam, self.coef = lam, torch.zeros(0)

    def fit(self, train_data, **kwargs) -> None:
        xs, ys, ws = zip(*[(x, y, w) for x, y, w in train_data], strict=True)
        x, y, w = torch.cat(xs).double(), torch.cat(ys).double().reshape(-1), torch.cat(ws).double().reshape(-1)
        x1 = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
        reg = torch.eye(x1.shape[1], dtype=x.dtype) * self.lam
        reg[-1, -1] = 0
        xtw = x1.T * w
        self.coef = torch.linalg.solve(xtw @ x1 + reg, xtw @ y)[:-1].float()

    def representation(self) -> torch.Tensor:
        return self.coef[None]
