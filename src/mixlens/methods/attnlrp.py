"""AttnLRP (Achtibat et al., ICML 2024, "AttnLRP: Attention-Aware Layer-wise Relevance Propagation for
Transformers"): the relevance of every input token for the scalar being explained (`mixlens.targets`: a class or
next-token logit, minus a foil's), in one forward and one backward pass.

The rules are applied as gradient × input with modified gradients (the authors' "efficient" formulation, lxt ≥ 2),
through forward hooks installed for the method's own pass and removed after it; the forward values are the
model's own, bit for bit (each hook returns `out.detach() + (s − s.detach())`, whose value is the module's output
and whose gradient is the one of a surrogate s):

- linear layers (and the embeddings' sums): the ε-rule with ε → 0, i.e. the plain gradient;
- LayerNorm / RMSNorm (every norm of the model, Gemma's (1 + w) and q/k norms included): the identity rule of
  the paper's Prop. 3.3 via a constant normalisation scale, s = γ ⊙ C(x) / stop_grad(σ(x));
- elementwise nonlinearities (GELU, SiLU, tanh — also the functional tanh of RoBERTa/MPNet classification heads
  and Gemma 2's logit soft-capping): the identity rule (Eq. 9), gradient out/in;
- the attention softmax: the paper's softmax rule (Eq. 13, R_i = x_i (R_i − s_i Σ_j R_j)), which is exactly the
  gradient × input of softmax, so the plain gradient;
- the bilinear products — q·k and A·v of attention, act(gate) ⊙ up of a gated FFN: the uniform rule (Eq. 7),
  the gradient of each factor halved; for attention this is the gradient at q and k divided by 4 (q·k, then the
  A·v product) and at v by 2, applied at the outputs of the q/k/v projections (a column factor for GPT-2's
  fused qkv), so nothing of the attention function is copied.

Relevance R_j = Σ_d e_jd ∂̃g/∂e_jd at the word embeddings e (the edit point `embed`, as the gradient methods). It is
conserved up to what biases, the softmax rule's bias term, position embeddings and masked terms absorb:
Σ_j R_j ≈ g(x); the difference Σ_j R_j − g(x) is returned as the extra `conservation` [B].

Memory: the pass runs attention in torch's fused kernels (no [B, H, n, n] kept) and each layer under activation
checkpointing (`trace.recomputed_layers`): the forward keeps only every layer's input [B, n, d], the backward runs
each layer again with the rules' hooks live, so a long input needs one layer's activations at a time. The rules are
gradient × input with stop-gradients, so the recomputed layer gives the same modified gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixlens.adapters import Adapter, Norm, get_path, linear_xw
from mixlens.errors import MixlensError
from mixlens.methods.memo import memo_of
from mixlens.methods.registry import TARGET_OPTIONS, TARGET_SCORES, Card, MethodOutput, Option, dense_ffn, register
from mixlens.methods.saliency import ROW_PASSES, Target, row_gradients, scalar_fn
from mixlens.targets import Request
from mixlens.trace import ForwardHook, Trace, recomputed_layers, scoped_hooks

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("attnlrp.md", "AttnLRP")

IDENTITY_EPS = 1e-10  # the identity rule's out / (in + ε), as lxt
NORM_RTOL = 1e-3  # a norm's surrogate must reproduce its output (else its form is not the one assumed)
_ACTIVATIONS = (nn.GELU, nn.SiLU, nn.Tanh, nn.ReLU, nn.Sigmoid, nn.Mish, nn.LeakyReLU, nn.Softplus)
_TANH = (torch.tanh, torch.Tensor.tanh, nn.functional.tanh)
VARIANTS = ("attnlrp", "cp")
RECOMPUTE_LAYERS = True  # each layer recomputed in the backward (False: all kept, the previous path; tests' oracle)


def _swap(out: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
    """`out`'s value with `surrogate`'s gradient."""
    return out.detach() + (surrogate - surrogate.detach()).to(out.dtype)


def scale_grad(t: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """t unchanged, its gradient multiplied by `factor` (the uniform rule of a bilinear product)."""
    f = factor.to(t) if isinstance(factor, torch.Tensor) else factor  # keep t's dtype (bfloat16 / float16 models)
    return t.detach() + (t - t.detach()) * f


def identity_rule(x: torch.Tensor, out: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    """`out` = f(x) elementwise, with the identity rule's gradient factor · f(x) / (x + ε)."""
    return _swap(out, x * (out / (x + IDENTITY_EPS)).detach() * factor)


def _is_norm(m: nn.Module) -> bool:
    name = type(m).__name__
    return isinstance(m, nn.LayerNorm) or name.endswith(("RMSNorm", "LayerNorm"))


def _is_activation(m: nn.Module) -> bool:
    return (
        type(m).__module__ == "transformers.activations"
        or isinstance(m, _ACTIVATIONS)
        or type(m).__name__ == "BloomGelu"  # BLOOM's own tanh-GELU module
    )


def _norm_hook(norm: Norm, path: str) -> Callable[..., torch.Tensor]:
    def hook(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0].float()
        scale = norm.scale(x.detach())[..., None]
        sur = norm.project(x) / scale
        want = out.detach().float() - norm.shift().detach().float()
        tol = NORM_RTOL if out.dtype == torch.float32 else 30 * NORM_RTOL  # half precision: ~3e-3 per value
        if not torch.allclose(sur.detach(), want, rtol=tol, atol=tol):
            raise MixlensError(f"attnlrp: the norm '{path}' ({type(m).__name__}) is not of the LayerNorm/RMSNorm form")
        return _swap(out, sur.to(out.dtype))  # the model's own dtype downstream (bfloat16 / float16 models)

    return hook


class _TanhIdentity(TorchFunctionMode):
    """The identity rule on functional tanh calls (classification heads, Gemma 2's soft-capping)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _TANH and isinstance(out, torch.Tensor) and out.requires_grad:
            return identity_rule(args[0] if args else (kwargs or {})["input"], out)
        return out


def _qkv(adapter: Adapter, layer: nn.Module, cp: bool) -> list[tuple[nn.Module, float | torch.Tensor]]:
    """The q, k and v projections of one layer with their gradient factors: (1/4, 1/4, 1/2), or for CP-LRP
    (0, 0, 1)."""
    fam = adapter.family
    fq, fv = (0.0, 1.0) if cp else (0.25, 0.5)
    parent_path, _, v_name = fam.v_proj.rpartition(".")
    parent = get_path(layer, parent_path) if parent_path else layer
    v = getattr(parent, v_name)
    if fam.qkv_groups:  # [H_kv, m, d_h] per key/value head, v last in each group (NeoX, BLOOM, Falcon)
        lay = next(lay for lay in adapter.layers if lay.module is layer)
        factor = torch.full((lay.n_kv_heads, v.weight.shape[0] // (lay.n_kv_heads * lay.d_head), lay.d_head), fq)
        factor[:, -1] = fv
        return [(v, factor.flatten())]
    if fam.fused_qkv:  # GPT-2's c_attn, Phi-3's qkv_proj, ModernBERT's Wqkv: [q | k | v]
        width, lay = linear_xw(v)[0].shape[1], adapter.layers[0]
        d_v = lay.n_kv_heads * lay.d_head
        return [(v, torch.tensor([fq] * (width - d_v) + [fv] * d_v))]
    if "value" in v_name:
        q_name, k_name = v_name.replace("value", "query"), v_name.replace("value", "key")
    else:
        q_name, k_name = v_name.replace("v", "q", 1), v_name.replace("v", "k", 1)
    if not (hasattr(parent, q_name) and hasattr(parent, k_name)):
        raise MixlensError(f"attnlrp: no query/key projections next to '{fam.v_proj}' in the {fam.name} family")
    return [(getattr(parent, q_name), fq), (getattr(parent, k_name), fq), (v, fv)]


def _scaled(factor: float | torch.Tensor) -> ForwardHook:
    """A hook scaling the gradient of a module's output by `factor` (the uniform rule)."""
    return lambda m, a, o: scale_grad(o, factor)


def _identity(factor: float) -> ForwardHook:
    """A hook giving an elementwise module the identity rule (times `factor`)."""
    return lambda m, a, o: identity_rule(a[0], o, factor)


def rule_hooks(adapter: Adapter, model: nn.Module, variant: str = "attnlrp") -> list[tuple[nn.Module, ForwardHook]]:
    """AttnLRP's rules (or CP-LRP's, `variant='cp'`) as (module, forward hook) pairs on `model`: the q/k/v outputs
    and a gated FFN's product scaled (uniform rule), every norm's and activation's output given its rule's gradient."""
    if variant not in VARIANTS:
        raise MixlensError(f"unknown LRP variant '{variant}'; valid: {', '.join(VARIANTS)}")
    cp = variant == "cp"
    hooks: list[tuple[nn.Module, ForwardHook]] = []
    gate, up = (0.0, 1.0) if cp else (0.5, 0.5)  # a gated FFN's act(gate) ⊙ up: uniform rule, or the gate constant
    fam = adapter.family
    gated: set[int] = set()  # activation modules that feed a gated product (factor 1/2)
    seen: set[int] = set()
    for lay in adapter.layers:
        if id(lay.module) in seen:  # ALBERT: shared layer modules
            continue
        seen.add(id(lay.module))
        for mod, factor in _qkv(adapter, lay.module, cp):
            hooks.append((mod, _scaled(factor)))
        if fam.ffn_gate is not None:
            mlp_path = fam.ffn_gate.rpartition(".")[0]
            mlp = get_path(lay.module, mlp_path) if mlp_path else lay.module
            acts = [c for c in mlp.children() if _is_activation(c)]
            if len(acts) != 1:
                raise MixlensError(f"attnlrp: cannot find the gate activation of the {fam.name} family's FFN")
            gated.add(id(acts[0]))
            f_up: float | torch.Tensor = up
            if lay.fused_gate_up:  # one projection [gate | up]: the gate half's factor is its activation's
                half = linear_xw(lay.ffn_in)[0].shape[-1] // 2
                f_up = torch.tensor([1.0] * half + [up] * half)
            hooks.append((lay.ffn_in, _scaled(f_up)))
    for path, m in model.named_modules():
        if _is_norm(m):
            layer_norm = isinstance(m, nn.LayerNorm)
            norm = Norm(m, rms=not layer_norm and "RMS" in type(m).__name__, offset=fam.norm_offset and not layer_norm)
            hooks.append((m, _norm_hook(norm, path)))
        elif _is_activation(m):
            factor = gate if id(m) in gated else 1.0
            hooks.append((m, _identity(factor)))
    return hooks


@contextmanager
def lrp_rules(adapter: Adapter, model: nn.Module, variant: str = "attnlrp") -> Iterator[None]:
    """AttnLRP's rules (or CP-LRP's, `variant='cp'`) as gradient modifications on `model`, for the forward passes
    run in the context: `rule_hooks` through trace's `scoped_hooks` (the model's lock held, all removed on exit) and
    a torch function mode for the functional tanh."""
    with scoped_hooks(adapter, rule_hooks(adapter, model, variant)), _TanhIdentity():
        yield


@register(
    "attnlrp",
    options=(
        *TARGET_OPTIONS,
        Option(
            "variant",
            str,
            "attnlrp",
            choices=VARIANTS,
            help="'attnlrp': relevance also through softmax and q·k (the paper); 'cp': CP-LRP, attention weights and "
            "FFN gates held constant",
        ),
    ),
    extras={"conservation": ()},
    supports=dense_ffn,
    recommended=("causal",),  # first or level with the first on BLiMP, every decoder tested (docs/findings/evaluate.md)
    backward=True,
    **TARGET_SCORES,
    card=Card(
        definition="R_j = Σ_d e_j ⊙ ∂̃g/∂e_j, the gradient modified by the AttnLRP rules (Achtibat et al. 2024: "
        "softmax, q·k and gates as in the paper; variant cp holds attention weights and gates constant); Σ_j R_j ≈ g "
        "(conservation extra).",
        passes="One forward and one modified backward pass of its own per batch, plus one more forward of the layers "
        "(each layer recomputed in the backward).",
        memory="Every layer's input (L·n·d) plus one layer's activations at a time; no [H, n, n] α kept (fused "
        "attention kernels; Gemma 2 and MPNet stay eager); output [n].",
        official="lxt 2.1 (the authors' package; `attnlrp` and `cp_LRP` on random GPT-2, Llama and Gemma 3)",
        tolerance="asserted atol 1e-6·max|R| + 1e-7; measured largest difference 1.1e-7 (relevances up to 0.55)",
        check="tests/methods/test_attnlrp.py::test_equals_lxt (skipped unless MIXLENS_LXT_PYTHON names a Python with "
        "lxt and transformers < 5)",
        background=BACKGROUND,
    ),
)
def attnlrp(
    trace: Trace,
    *,
    target: Target = "pred",
    foil: int | None = None,
    position: int | None = None,
    variant: str = "attnlrp",
) -> MethodOutput:
    """AttnLRP relevance of each token for a target scalar (logit, or logit difference with a foil): [B, source].

    Extra `conservation` [B]: Σ_j R_j − g(x), what the rules did not conserve (biases, softmax, positions)."""
    if isinstance(target, Request) and target.logprob:  # AttnLRP relevance is of the logit (answers' rows too)
        target = dataclasses.replace(target, logprob=False)
    hit = memo_of(trace).get(("attnlrp", target, variant)) if isinstance(target, Request) else None
    if hit is not None:  # computed with the other rows of an answer (`rows`)
        return hit
    recompute: AbstractContextManager[None] = recomputed_layers(_TanhIdentity) if RECOMPUTE_LAYERS else nullcontext()
    with lrp_rules(trace.adapter, trace.model, variant), recompute:  # the backward inside: it reruns the layers
        _, emb, _, value, _ = scalar_fn(trace, target, foil, position, grad=True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(value.sum(), emb)  # inputs are independent: row b is ∂̃g_b/∂e
    mask = trace.mask.to(torch.float32)
    rel = (grad * emb.detach()).float().sum(-1) * mask
    return MethodOutput(rel, {"conservation": rel.sum(-1) - value.detach().float()})


def rows(trace: Trace, requests: Sequence[Request], variant: str = "attnlrp") -> None:
    """AttnLRP of several requests on one input (the tokens of an answer): one forward under the rules, one
    backward per request (`saliency.row_gradients`), each result kept in the trace's memo for `attnlrp`'s call."""
    reqs = [dataclasses.replace(r, logprob=False) for r in requests]
    memo = memo_of(trace)
    recompute: AbstractContextManager[None] = recomputed_layers(_TanhIdentity) if RECOMPUTE_LAYERS else nullcontext()
    with lrp_rules(trace.adapter, trace.model, variant), recompute:  # the backwards inside: they rerun the layers
        grads = row_gradients(trace, reqs)
    for req, (grad, emb, value) in zip(reqs, grads, strict=True):
        rel = (grad * emb).float().sum(-1) * trace.mask.to(torch.float32)
        memo.put(("attnlrp", req, variant), MethodOutput(rel, {"conservation": rel.sum(-1) - value.float()}))


ROW_PASSES["attnlrp"] = rows
