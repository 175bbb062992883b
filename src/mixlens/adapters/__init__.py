"""Per-family adapter table: where each canonical piece of a Transformer layer lives.

An adapter never copies modeling code. It names module paths (relative to one layer) and says how the
block is wired (post-LN encoder or pre-LN decoder, LayerNorm or RMSNorm, Gemma's sandwich norm).
`resolve(model)` turns the table entry into concrete modules and weight matrices in the canonical `x @ W` orientation.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixlens.errors import MixlensError


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    layers: str  # path from the base model to the layer ModuleList
    pre_ln: bool  # True: x + Attn(LN(x)) (GPT-2, Llama); False: LN(x + Attn(x)) (BERT)
    rms: bool  # RMSNorm instead of LayerNorm
    attn: str  # the attention module whose eager attention call is captured
    v_proj: str  # value projection (a fused qkv for GPT-2)
    o_proj: str  # attention output projection
    ln_mix: str  # norm fed by the attention residual sum (post-LN: LN1; pre-LN: LN before the FFN; parallel: "")
    ffn_in: str  # first FFN projection (its output is the pre-activation)
    ffn_out: str  # last FFN projection (its input is the post-activation)
    ln_in: str | None = None  # pre-LN only: the norm applied to x before attention
    ln_out: str | None = None  # post-LN only: the norm after the FFN residual sum (LN2)
    ffn_gate: str | None = None  # gated FFN (Llama)
    ln_post: str | None = None  # sandwich norm on the attention output before the residual sum (Gemma 2/3)
    norm_offset: bool = False  # norms scale by (1 + w) (Gemma)
    causal: bool = False
    fused_qkv: bool = False
    inplace_attention: bool = False  # the trace may compute its attention in place (`mixlens.inplace`), where that
    # gives the floats of the family's own code (checked on first use)
    probs: str | None = None  # attention not routed through ALL_ATTENTION_FUNCTIONS: the module whose output is α
    # (MPNet's attention dropout); α, v and z are then captured and edited by hooks on probs, v_proj and o_proj
    final_norm: str | None = None  # pre-LN: path from the base model to the norm before the head (default: the
    # first of `ln_f`, `norm` that exists)
    fused_gate_up: bool = False  # ffn_in = ffn_gate = one projection whose output is [gate | up] (Phi-3, ModernBERT)
    multipliers: bool = False  # Granite: each branch enters the residual stream times config.residual_multiplier and
    # the logits are divided by config.logits_scaling (its embedding and attention multipliers need nothing: they
    # act before the first layer and inside α)
    moe: bool = False  # the FFN routes each token through experts (Mixtral, Qwen3-MoE): ffn_in = ffn_out = the whole
    # sparse block, whose output is the FFN update; its inside (router, experts) is no adapter piece
    layer_tuple: bool = False  # the layer module returns a tuple (hidden states, ...) that its encoder indexes (MPNet,
    # DeBERTa): so does a skipped one
    check: Callable[[Any], str | None] | None = None  # config → why this family's layout is outside the adapter's
    # math (one line; e.g. mixing outside attention), or None
    ln_mix_unit: bool = False  # no norm follows the attention residual sum (OLMo 2: h = x + g^post(Attn(x))):
    # `ln_mix` names the module the sum feeds (the FFN); the trace captures the sum at its input and the engine's
    # ln_mix is the identity (`identity_norm`, as in a parallel block), so N-ResLN = N-Res and ResLN-N = Res-N
    final_proj: str | None = None  # a bias-free linear map after the final norm, before the head (OPT's project_out)
    parallel: bool = False  # x + Attn(ln_in(x)) + FFN(ln_ffn(x)) (NeoX, Falcon): no norm after the attention residual
    # sum, so `ln_mix` is the identity (docs/DESIGN.md §3.6, "Parallel blocks")
    ln_ffn: str | None = None  # parallel blocks: the norm whose output the FFN reads (it may be ln_in itself)
    qkv_groups: bool = False  # a fused qkv laid out per key/value head, [H_kv, m, d_h] with v last in each group
    # (NeoX, BLOOM: [H, 3, d_h]; Falcon: [H_kv, H / H_kv + 2, d_h]); else GPT-2's [q | k | v]
    row_mode: bool = True  # α's rows can be rebuilt from q, K and an index mask (`mixlens.rowattn`); False: the
    # attention adds a per-head bias (ALiBi) or is computed by the family's own code, so a trace keeps α
    kv_heads: int | None = None  # key/value heads, where the config's `num_key_value_heads` may not say (set by
    # `layout`: Falcon derives them from multi_query / new_decoder_architecture as its attention does)
    layout: Callable[[Any], dict[str, Any]] | None = None  # config → the fields that differ for this config from
    # the entry, which describes the default config (a variant of the block: OPT's do_layer_norm_before, NeoX's
    # use_parallel_residual, Falcon's layouts); raises MixlensError for a variant outside the math


_BERT_LIKE: dict[str, Any] = dict(
    layers="encoder.layer",
    pre_ln=False,
    rms=False,
    attn="attention.self",
    v_proj="attention.self.value",
    o_proj="attention.output.dense",
    ln_mix="attention.output.LayerNorm",
    ffn_in="intermediate.dense",
    ffn_out="output.dense",
    ln_out="output.LayerNorm",
    inplace_attention=True,
)
# Pre-RMSNorm decoders with a gated FFN; Llama and Gemma differ in the norm that follows the attention residual sum.
_LLAMA_LIKE: dict[str, Any] = dict(
    layers="layers",
    pre_ln=True,
    rms=True,
    attn="self_attn",
    v_proj="self_attn.v_proj",
    o_proj="self_attn.o_proj",
    ffn_in="mlp.up_proj",
    ffn_out="mlp.down_proj",
    ln_in="input_layernorm",
    ffn_gate="mlp.gate_proj",
    causal=True,
    inplace_attention=True,
)


# ---- parallel blocks, ALiBi, learned positions (OPT, BLOOM, GPT-NeoX, Falcon): the per-config variants ----


def _opt_layout(cfg: Any) -> dict[str, Any]:
    """OPT: pre-LN (`do_layer_norm_before`, 125m and ≥ 1.3b) or post-LN like BERT (350m)."""
    if not getattr(cfg, "layer_norm_elementwise_affine", True):
        raise MixlensError("'opt' with layer_norm_elementwise_affine=False (norms without γ, β) is not supported")
    if cfg.do_layer_norm_before:
        return {} if not getattr(cfg, "_remove_final_layer_norm", False) else {"final_norm": None}
    return dict(pre_ln=False, ln_in=None, ln_mix="self_attn_layer_norm", ln_out="final_layer_norm", final_norm=None)


def _bloom_layout(cfg: Any) -> dict[str, Any]:
    if getattr(cfg, "apply_residual_connection_post_layernorm", False):
        raise MixlensError(
            "'bloom' with apply_residual_connection_post_layernorm=True (the residual is LN(x)) is not supported"
        )
    if getattr(cfg, "pretraining_tp", 1) > 1 and getattr(cfg, "slow_but_exact", False):
        raise MixlensError(
            "'bloom' with slow_but_exact=True and pretraining_tp > 1 (a sliced output projection) is not supported"
        )
    return {}


def _neox_layout(cfg: Any) -> dict[str, Any]:
    """GPT-NeoX / Pythia: parallel (`use_parallel_residual`, the default: the table's entry) or sequential pre-LN."""
    return {} if cfg.use_parallel_residual else dict(parallel=False, ln_mix="post_attention_layernorm", ln_ffn=None)


def _falcon_layout(cfg: Any) -> dict[str, Any]:
    """Falcon: parallel attention + MLP with one norm (7b) or two (`new_decoder_architecture`, 40b / 180b), or a
    sequential pre-LN block (`parallel_attn=False`); ALiBi (`alibi`) keeps α whole in a trace."""
    kv = cfg.num_kv_heads if cfg.new_decoder_architecture or not cfg.multi_query else 1
    out: dict[str, Any] = {"row_mode": not cfg.alibi, "kv_heads": kv}
    if cfg.new_decoder_architecture:
        if not cfg.parallel_attn:
            raise MixlensError("'falcon' with new_decoder_architecture and parallel_attn=False is not supported")
        if cfg.num_ln_in_parallel_attn in (None, 2):
            return {**out, "ln_in": "ln_attn", "ln_ffn": "ln_mlp"}
        return out
    if cfg.parallel_attn:  # the table's entry
        return out
    return {**out, "parallel": False, "ln_mix": "post_attention_layernorm", "ln_ffn": None}


_FUSED_GROUPS: dict[str, Any] = dict(pre_ln=True, rms=False, causal=True, fused_qkv=True, qkv_groups=True)

FAMILIES: tuple[Family, ...] = (
    Family("bert", ("bert",), **_BERT_LIKE),
    Family("roberta", ("roberta", "xlm-roberta"), **_BERT_LIKE),
    Family("electra", ("electra",), **_BERT_LIKE),
    Family(
        "distilbert",
        ("distilbert",),
        layers="transformer.layer",
        pre_ln=False,
        rms=False,
        attn="attention",
        v_proj="attention.v_lin",
        o_proj="attention.out_lin",
        ln_mix="sa_layer_norm",
        ffn_in="ffn.lin1",
        ffn_out="ffn.lin2",
        ln_out="output_layer_norm",
        inplace_attention=True,
    ),
    Family(
        "albert",
        ("albert",),
        layers="encoder.albert_layer_groups",
        pre_ln=False,
        rms=False,
        attn="attention",
        v_proj="attention.value",
        o_proj="attention.dense",
        ln_mix="attention.LayerNorm",
        ffn_in="ffn",
        ffn_out="ffn_output",
        ln_out="full_layer_layer_norm",
        inplace_attention=True,
    ),
    Family(
        "mpnet",
        ("mpnet",),
        layers="encoder.layer",
        pre_ln=False,
        rms=False,
        attn="attention.attn",
        v_proj="attention.attn.v",
        o_proj="attention.attn.o",
        ln_mix="attention.LayerNorm",
        ffn_in="intermediate.dense",
        ffn_out="output.dense",
        ln_out="output.LayerNorm",
        probs="attention.attn.dropout",
        inplace_attention=True,
        layer_tuple=True,
    ),
    Family(
        "gpt2",
        ("gpt2",),
        layers="h",
        pre_ln=True,
        rms=False,
        attn="attn",
        v_proj="attn.c_attn",
        o_proj="attn.c_proj",
        ln_mix="ln_2",
        ffn_in="mlp.c_fc",
        ffn_out="mlp.c_proj",
        ln_in="ln_1",
        causal=True,
        fused_qkv=True,
    ),
    Family("llama", ("llama", "mistral", "qwen2"), ln_mix="post_attention_layernorm", **_LLAMA_LIKE),
    Family(
        "gemma",
        ("gemma2", "gemma3_text"),
        ln_mix="pre_feedforward_layernorm",
        ln_post="post_attention_layernorm",
        norm_offset=True,
        **_LLAMA_LIKE,
    ),
    # Decoders of the last years (issue 42): q/k norms and rope scaling change α only; the other layouts are traits.
    Family("qwen3", ("qwen3",), ln_mix="post_attention_layernorm", **_LLAMA_LIKE),
    Family(
        "starcoder2",
        ("starcoder2",),
        ln_mix="post_attention_layernorm",
        **{**_LLAMA_LIKE, "rms": False, "ffn_in": "mlp.c_fc", "ffn_out": "mlp.c_proj", "ffn_gate": None},
    ),
    Family(
        "phi3",
        ("phi3",),
        ln_mix="post_attention_layernorm",
        **{
            **_LLAMA_LIKE,
            "v_proj": "self_attn.qkv_proj",
            "fused_qkv": True,
            "ffn_in": "mlp.gate_up_proj",
            "ffn_gate": "mlp.gate_up_proj",
            "fused_gate_up": True,
        },
    ),
    Family("granite", ("granite",), ln_mix="post_attention_layernorm", multipliers=True, **_LLAMA_LIKE),
    Family(
        "olmo2",
        ("olmo2",),
        layers="layers",
        pre_ln=True,
        rms=True,
        attn="self_attn",
        v_proj="self_attn.v_proj",
        o_proj="self_attn.o_proj",
        ln_mix="mlp",
        ffn_in="mlp.up_proj",
        ffn_out="mlp.down_proj",
        ffn_gate="mlp.gate_proj",
        ln_post="post_attention_layernorm",
        causal=True,
        inplace_attention=True,
        ln_mix_unit=True,
    ),
    Family(
        "moe",
        ("mixtral", "qwen3_moe"),
        ln_mix="post_attention_layernorm",
        moe=True,
        **{**_LLAMA_LIKE, "ffn_in": "mlp", "ffn_out": "mlp", "ffn_gate": None},
    ),
    # Encoders of today (DESIGN.md §3.6): ModernBERT (pre-LN, rotary, local/global attention, fused Wqkv and GLU Wi;
    # its first layer has no attention norm) and DeBERTa v2/v3 (post-LN; disentangled attention in its own code).
    Family(
        "modernbert",
        ("modernbert",),
        layers="layers",
        pre_ln=True,
        rms=False,
        attn="attn",
        v_proj="attn.Wqkv",
        o_proj="attn.Wo",
        ln_mix="mlp_norm",
        ffn_in="mlp.Wi",
        ffn_out="mlp.Wo",
        ln_in="attn_norm",
        ffn_gate="mlp.Wi",
        fused_qkv=True,
        inplace_attention=True,
        fused_gate_up=True,
    ),
    Family(
        "deberta-v2",
        ("deberta-v2",),
        layers="encoder.layer",
        pre_ln=False,
        rms=False,
        attn="attention.self",
        v_proj="attention.self.value_proj",
        o_proj="attention.output.dense",
        ln_mix="attention.output.LayerNorm",
        ffn_in="intermediate.dense",
        ffn_out="output.dense",
        ln_out="output.LayerNorm",
        probs="attention.self.dropout",
        layer_tuple=True,
        check=lambda cfg: _deberta_check(cfg),
    ),
    # parallel blocks, ALiBi, learned positions (docs/DESIGN.md §3.6)
    Family(
        "opt",
        ("opt",),
        layers="decoder.layers",
        pre_ln=True,
        rms=False,
        attn="self_attn",
        v_proj="self_attn.v_proj",
        o_proj="self_attn.out_proj",
        ln_mix="final_layer_norm",
        ffn_in="fc1",
        ffn_out="fc2",
        ln_in="self_attn_layer_norm",
        causal=True,
        inplace_attention=True,
        final_norm="decoder.final_layer_norm",
        final_proj="decoder.project_out",
        layout=_opt_layout,
    ),
    Family(
        "bloom",
        ("bloom",),
        layers="h",
        attn="self_attention",
        v_proj="self_attention.query_key_value",
        o_proj="self_attention.dense",
        ln_mix="post_attention_layernorm",
        ffn_in="mlp.dense_h_to_4h",
        ffn_out="mlp.dense_4h_to_h",
        ln_in="input_layernorm",
        probs="self_attention.attention_dropout",
        row_mode=False,
        final_norm="ln_f",
        layout=_bloom_layout,
        **_FUSED_GROUPS,
    ),
    Family(
        "gpt_neox",
        ("gpt_neox",),
        layers="layers",
        attn="attention",
        v_proj="attention.query_key_value",
        o_proj="attention.dense",
        ln_mix="",  # parallel: none (the identity)
        ffn_in="mlp.dense_h_to_4h",
        ffn_out="mlp.dense_4h_to_h",
        ln_in="input_layernorm",
        inplace_attention=True,
        final_norm="final_layer_norm",
        parallel=True,
        ln_ffn="post_attention_layernorm",
        layout=_neox_layout,
        **_FUSED_GROUPS,
    ),
    Family(
        "falcon",
        ("falcon",),
        layers="h",
        attn="self_attention",
        v_proj="self_attention.query_key_value",
        o_proj="self_attention.dense",
        ln_mix="",  # parallel: none (the identity)
        ffn_in="mlp.dense_h_to_4h",
        ffn_out="mlp.dense_4h_to_h",
        ln_in="input_layernorm",
        inplace_attention=True,
        final_norm="ln_f",
        parallel=True,
        ln_ffn="input_layernorm",  # the same norm as attention's (7b); `ln_mlp` with two norms (40b, 180b)
        layout=_falcon_layout,
        **_FUSED_GROUPS,
    ),
)


def _deberta_check(cfg: Any) -> str | None:
    """DeBERTa v2's optional convolution after the first layer mixes neighbouring tokens outside attention."""
    if getattr(cfg, "conv_kernel_size", 0) > 0:
        return (
            f"this deberta-v2 model adds a convolution (conv_kernel_size={cfg.conv_kernel_size}) after its first "
            "layer, which mixes tokens outside attention; mixlens decomposes mixing by attention only (DeBERTa-v3 has "
            "no convolution)"
        )
    if getattr(cfg, "z_steps", 0) > 1:
        return "a deberta-v2 model with z_steps > 1 reruns its last layer outside the layer stack"
    return None


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)


def family_named(name: str) -> Family:
    """The family of this name (`--family NAME`, `load(family=...)`); one line listing the names otherwise."""
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise MixlensError(f"unknown family '{name}'; families: {', '.join(f.name for f in FAMILIES)} (mixlens families)")


def known_family(model_type: str) -> Family | None:
    """The family whose table entry lists this model type, or None (it may still be tried: `mixlens.layouts`)."""
    return next((fam for fam in FAMILIES if model_type in fam.model_types), None)


def family_for(model_type: str) -> Family:
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    raise MixlensError(
        f"unsupported architecture '{model_type}'; supported model types: {', '.join(supported_model_types())}"
    )


def logit_scale(adapter: Adapter) -> float:
    """The factor between the head's linear map and the model's logits (Granite: 1 / logits_scaling)."""
    return 1.0 / float(adapter.base.config.logits_scaling) if adapter.family.multipliers else 1.0


def ffn_out_xw(lay: Layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W [d_ff, d], b) of the FFN's last projection as its output enters the residual stream (times the branch
    scale, Granite)."""
    w, b = linear_xw(lay.ffn_out)
    if lay.branch_scale == 1.0:
        return w, b
    return w * lay.branch_scale, None if b is None else b * lay.branch_scale


def ffn_in_xw(lay: Layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W [d, d_ff], b) of the FFN's linear input projection (the up projection of a gated FFN; of a fused
    [gate | up] projection its second half)."""
    w, b = linear_xw(lay.ffn_in)
    if not lay.fused_gate_up:
        return w, b
    half = w.shape[1] // 2
    return w[:, half:], None if b is None else b[half:]


def linear_xw(mod: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W [in, out], b [out] | None) such that mod(x) = x @ W + b; handles nn.Linear and GPT-2 Conv1D."""
    if isinstance(mod, nn.Linear):
        return mod.weight.T, mod.bias
    return mod.weight, mod.bias  # transformers Conv1D stores [in, out]


def float32(t: torch.Tensor | None, cache: dict, name: str, shift: float = 0.0) -> Any:
    """`t` (+ `shift`) in float32, upcast once per weight version (`cache[name]`); a float32 `t` without shift is
    returned itself. A model may run in bfloat16 or float16 (`mixlens.load(dtype=...)`): every decomposition
    accumulates in float32."""
    if t is None or (t.dtype == torch.float32 and not shift):
        return t
    key = (t.data_ptr(), t._version, t.dtype, t.shape)
    hit = cache.get(name)
    # the same tensor object (a weak reference: a replaced weight freed and reallocated at the same address with
    # the same version is another tensor) at the same version
    if hit is None or hit[0] != key or hit[1]() is not t:
        hit = cache[name] = (key, weakref.ref(t), t.detach().float() + shift if shift else t.detach().float())
    return hit[2]


@dataclass
class Norm:
    """A LayerNorm or RMSNorm as the per-target linear map of docs/DESIGN.md §3.3: g_i(v) = γ ⊙ C(v) / s_i."""

    module: nn.Module
    rms: bool
    offset: bool = False  # the module scales by (1 + weight) (Gemma)
    _float32: dict = field(default_factory=dict, repr=False, compare=False)
    identity: bool = False  # no norm at all (`NoNorm`: a parallel block's ln_mix): g_i(v) = v, s_i = 1

    @property
    def weight(self) -> torch.Tensor:
        """γ in float32: the module's weight, or 1 + weight for (1 + w) norms (one tensor per weight version)."""
        w = self.module.weight
        assert isinstance(w, torch.Tensor)  # a norm's γ is a Parameter, not a submodule
        return float32(w, self._float32, "weight", 1.0 if self.offset else 0.0)

    @property
    def bias(self) -> torch.Tensor | None:
        """β in float32 (None for RMSNorm)."""
        return float32(getattr(self.module, "bias", None), self._float32, "bias")

    @property
    def eps(self) -> float:
        for name in ("eps", "variance_epsilon"):
            if hasattr(self.module, name):
                return float(getattr(self.module, name))
        raise MixlensError(f"cannot find eps of {type(self.module).__name__}")

    def center(self, v: torch.Tensor) -> torch.Tensor:
        """C(v): subtract the mean over the hidden axis (identity for RMSNorm)."""
        return v if self.rms else v - v.mean(-1, keepdim=True)

    def project(self, v: torch.Tensor) -> torch.Tensor:
        """P(v) = γ ⊙ C(v), the scale-free part of g."""
        return self.center(v) * self.weight

    def scale(self, y: torch.Tensor) -> torch.Tensor:
        """s_i from the real pre-norm vectors y [..., d] → [...] (biased variance of the whole vector)."""
        if self.identity:
            return torch.ones_like(y[..., 0])
        c = self.center(y)
        return torch.sqrt(c.pow(2).mean(-1) + self.eps)

    def shift(self) -> torch.Tensor:
        return self.bias if self.bias is not None else torch.zeros_like(self.weight)


class NoNorm(nn.Module):
    """The identity where a block has no norm after the attention residual sum (parallel blocks, OLMo 2): the trace
    passes that sum, x + attention output, through it, so its hooks record `mix_in` = `mix_out` as for a real norm. It
    is mixlens's own object, never a submodule of the model."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("weight", torch.ones(d), persistent=False)
        self.eps = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def identity_norm(d: int, device: torch.device | None = None) -> Norm:
    """The engine's `ln_mix` where no norm follows the attention residual sum (parallel blocks, OLMo 2): the
    identity, so N-ResLN = N-Res and the ResLN-N ratio equals Res-N (docs/DESIGN.md §3.6)."""
    return Norm(NoNorm(d).to(device), rms=True, identity=True)


def final_norm(adapter: Adapter) -> Norm | None:
    """The norm between the last layer and the model head (`Family.final_norm`, else the base model's `ln_f` or
    `norm`), None where there is none (a post-LN model)."""
    fam, base = adapter.family, adapter.base
    if fam.final_norm is not None:
        module = get_path(base, fam.final_norm)
    else:
        module = getattr(base, "ln_f", None)
        module = getattr(base, "norm", None) if module is None else module
    return None if module is None else Norm(module, fam.rms, fam.norm_offset)


def final_proj(adapter: Adapter) -> nn.Module | None:
    """The bias-free linear map after the final norm, before the model head (OPT's `project_out`), if the model has
    one."""
    path = adapter.family.final_proj
    return None if path is None else get_path(adapter.base, path)


@dataclass
class Layer:
    """Concrete modules of one layer (ALBERT repeats the same objects)."""

    module: nn.Module
    attn: nn.Module
    n_heads: int
    n_kv_heads: int
    d_head: int
    o_proj: nn.Module  # the module whose output is the real attention output: the output projection, or the
    # sandwich norm after it (Gemma)
    raw_w_o: torch.Tensor  # [H * d_head, d]  W_O, or W_O diag(γ_post) with a sandwich norm, as the model holds it
    raw_b_o: torch.Tensor | None  # [d]
    raw_w_v: torch.Tensor  # [d, H_kv * d_head]
    raw_b_v: torch.Tensor | None
    ln_mix: Norm
    ffn_in: nn.Module
    ffn_out: nn.Module
    ln_in: Norm | None
    ln_out: Norm | None
    ffn_gate: nn.Module | None
    ln_post: Norm | None = None  # sandwich norm: attention output = g^post(o_proj output) (its s_i is traced)
    proj: nn.Module | None = None  # the output projection itself when `o_proj` is the sandwich norm after it
    fused_gate_up: bool = False  # ffn_in's output is [gate | up] (Phi-3): `ffn_in_xw` and the trace take the up half
    mix_at: nn.Module | None = None  # the module fed by the attention residual sum when ln_mix is no model module
    # (`Family.ln_mix_unit`): the trace captures the sum at its input and applies ln_mix itself
    branch_scale: float = 1.0  # the attention and FFN outputs enter the residual stream times this (Granite); it is
    # folded into raw_w_o / raw_b_o, and the trace's attention and FFN outputs are captured after it
    _float32: dict = field(default_factory=dict, repr=False, compare=False)  # float32 copies of raw_* weights
    ln_ffn: Norm | None = None  # parallel blocks: the norm whose output the FFN reads (ln_mix is then the identity)

    # The weights in float32 (themselves for a float32 model; else upcast once per weight version).
    @property
    def w_o(self) -> torch.Tensor:
        return float32(self.raw_w_o, self._float32, "w_o")

    @property
    def b_o(self) -> torch.Tensor | None:
        return float32(self.raw_b_o, self._float32, "b_o")

    @property
    def w_v(self) -> torch.Tensor:
        return float32(self.raw_w_v, self._float32, "w_v")

    @property
    def b_v(self) -> torch.Tensor | None:
        return float32(self.raw_b_v, self._float32, "b_v")


@dataclass
class Adapter:
    family: Family
    base: Any  # the base encoder/decoder inside any AutoModel head (a transformers model: dynamic attributes)
    layers: list[Layer]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_heads(self) -> int:
        return self.layers[0].n_heads


def get_path(root: nn.Module, path: str) -> Any:
    """The submodule at a dotted path (HF modules: attributes and list indices)."""
    mod: Any = root
    for part in path.split("."):
        mod = getattr(mod, part) if not part.isdigit() else mod[int(part)]
    return mod


def _layer_modules(fam: Family, base: Any) -> list[nn.Module]:
    if fam.name != "albert":
        return list(get_path(base, fam.layers))
    cfg = base.config  # ALBERT: groups of shared layers, each called L/G times in order
    groups = get_path(base, fam.layers)
    n, g = cfg.num_hidden_layers, cfg.num_hidden_groups
    return [m for i in range(n) for m in groups[int(i / (n / g))].albert_layers]


def resolve(model: Any, family: Family | None = None) -> Adapter:
    """Find the family of an HF model (any AutoModel head) and its per-layer modules; `family`: read the model
    under that family's layout instead of its model type's (checked by `mixlens.layouts`)."""
    cfg = model.config
    fam = family or family_for(cfg.model_type)
    if fam.layout is not None:  # this config's variant of the block
        fam = dataclasses.replace(fam, **fam.layout(cfg))
    base = model.base_model
    n_heads = cfg.num_attention_heads
    n_kv = fam.kv_heads or getattr(cfg, "num_key_value_heads", None) or n_heads
    layers = []

    why = fam.check(cfg) if fam.check is not None else None
    if why is not None:
        raise MixlensError(why)

    def norm(mod: nn.Module, path: str | None) -> Norm | None:
        if not path or isinstance(get_path(mod, path), nn.Identity):  # ModernBERT's first layer: no attention norm
            return None
        return Norm(get_path(mod, path), fam.rms, fam.norm_offset)

    for mod in _layer_modules(fam, base):
        proj = get_path(mod, fam.o_proj)
        w_o, b_o = linear_xw(proj)
        w_v, b_v = linear_xw(get_path(mod, fam.v_proj))
        if fam.qkv_groups:  # [H_kv, m, d_h] per key/value head, v last in each group
            d_h = w_o.shape[0] // n_heads
            w_v = w_v.unflatten(1, (n_kv, -1, d_h))[:, :, -1].flatten(1)
            b_v = b_v.unflatten(0, (n_kv, -1, d_h))[:, -1].flatten() if b_v is not None else None
        elif fam.fused_qkv:  # GPT-2 c_attn, Phi-3 qkv_proj, ModernBERT Wqkv: [q | k | v], v the last H_kv · d_head
            start = w_v.shape[1] - n_kv * (w_o.shape[0] // n_heads)
            w_v, b_v = w_v[:, start:], (b_v[start:] if b_v is not None else None)
        scale = float(cfg.residual_multiplier) if fam.multipliers else 1.0
        if scale != 1.0:  # Granite: x + m · o_proj(...): m folded into W_O and b_O
            w_o, b_o = w_o * scale, None if b_o is None else b_o * scale
        ln_post = norm(mod, fam.ln_post)
        mix_at, ln_mix = None, None
        if fam.ln_mix_unit:
            mix_at, ln_mix = get_path(mod, fam.ln_mix), identity_norm(w_o.shape[1], w_o.device)
        if ln_post is not None:  # g^post_i(Σ α f) = Σ (α / s_i) (γ_post ⊙ f): γ_post goes into W_O, 1/s_i into α
            if b_o is not None:
                raise MixlensError(
                    f"'{cfg.model_type}' with an attention output bias before the sandwich norm is not supported"
                )
            w_o = w_o.float() * ln_post.weight
        layers.append(
            Layer(
                module=mod,
                attn=get_path(mod, fam.attn),
                n_heads=n_heads,
                n_kv_heads=n_kv,
                d_head=w_o.shape[0] // n_heads,
                o_proj=proj if ln_post is None else ln_post.module,
                raw_w_o=w_o,
                raw_b_o=b_o,
                raw_w_v=w_v,
                raw_b_v=b_v,
                ln_mix=ln_mix
                or (
                    identity_norm(w_o.shape[1], w_o.device)
                    if fam.parallel
                    else Norm(get_path(mod, fam.ln_mix), fam.rms, fam.norm_offset)
                ),
                ffn_in=get_path(mod, fam.ffn_in),
                ffn_out=get_path(mod, fam.ffn_out),
                ln_in=norm(mod, fam.ln_in),
                ln_out=norm(mod, fam.ln_out),
                ffn_gate=get_path(mod, fam.ffn_gate) if fam.ffn_gate else None,
                ln_post=ln_post,
                proj=None if ln_post is None else proj,
                fused_gate_up=fam.fused_gate_up,
                branch_scale=scale,
                mix_at=mix_at,
                ln_ffn=norm(mod, fam.ln_ffn),
            )
        )
    return Adapter(family=fam, base=base, layers=layers)
