"""Per-family adapter table: where each canonical piece of a Transformer layer lives.

An adapter never copies modeling code. It names module paths (relative to one layer) and says how the
block is wired (post-LN encoder or pre-LN decoder, LayerNorm or RMSNorm, Gemma's sandwich norm).
`resolve(model)` turns the table entry into concrete modules and weight matrices in the canonical `x @ W` orientation.
"""

from __future__ import annotations

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
    ln_mix: str  # norm fed by the attention residual sum (post-LN: LN1; pre-LN: LN before the FFN)
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
    fused_gate_up: bool = False  # ffn_in = ffn_gate = one projection whose output is [gate | up] (Phi-3)
    multipliers: bool = False  # Granite: each branch enters the residual stream times config.residual_multiplier and
    # the logits are divided by config.logits_scaling (its embedding and attention multipliers need nothing: they
    # act before the first layer and inside α)
    moe: bool = False  # the FFN routes each token through experts (Mixtral, Qwen3-MoE): ffn_in = ffn_out = the whole
    # sparse block, whose output is the FFN update; its inside (router, experts) is no adapter piece
    ln_mix_unit: bool = False  # no norm follows the attention residual sum (OLMo 2: h = x + g^post(Attn(x))):
    # `ln_mix` names the module the sum feeds (the FFN) and the engine's ln_mix is a unit RMSNorm (γ = 1, the model's
    # eps) that mixlens applies to the captured sum itself, so N-ResLN = N-Res / s_i (refused) and ResLN-N = Res-N


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
)


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


def final_norm(adapter: Adapter) -> Norm:
    """The norm between a pre-LN decoder's last layer and its head (GPT-2's ln_f, Llama's norm)."""
    fam, base = adapter.family, adapter.base
    paths = (fam.final_norm,) if fam.final_norm else ("ln_f", "norm")
    for path in paths:
        module = getattr(base, path, None)
        if module is not None:
            return Norm(module, fam.rms, fam.norm_offset)
    raise MixlensError(f"cannot find the final norm of {type(base).__name__}")


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
    if hit is None or hit[0] != key:
        hit = cache[name] = (key, t.detach().float() + shift if shift else t.detach().float())
    return hit[1]


@dataclass
class Norm:
    """A LayerNorm or RMSNorm as the per-target linear map of docs/DESIGN.md §3.3: g_i(v) = γ ⊙ C(v) / s_i."""

    module: nn.Module
    rms: bool
    offset: bool = False  # the module scales by (1 + weight) (Gemma)
    _float32: dict = field(default_factory=dict, repr=False, compare=False)

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
        c = self.center(y)
        return torch.sqrt(c.pow(2).mean(-1) + self.eps)

    def shift(self) -> torch.Tensor:
        return self.bias if self.bias is not None else torch.zeros_like(self.weight)


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
    base = model.base_model
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    layers = []

    def norm(mod: nn.Module, path: str | None) -> Norm | None:
        return Norm(get_path(mod, path), fam.rms, fam.norm_offset) if path else None

    for mod in _layer_modules(fam, base):
        proj = get_path(mod, fam.o_proj)
        w_o, b_o = linear_xw(proj)
        w_v, b_v = linear_xw(get_path(mod, fam.v_proj))
        if fam.fused_qkv:  # GPT-2 c_attn, Phi-3 qkv_proj: [q | k | v], v the last H_kv · d_head columns
            start = w_v.shape[1] - n_kv * (w_o.shape[0] // n_heads)
            w_v, b_v = w_v[:, start:], (b_v[start:] if b_v is not None else None)
        scale = float(cfg.residual_multiplier) if fam.multipliers else 1.0
        if scale != 1.0:  # Granite: x + m · o_proj(...): m folded into W_O and b_O
            w_o, b_o = w_o * scale, None if b_o is None else b_o * scale
        ln_post = norm(mod, fam.ln_post)
        mix_at, ln_mix = None, None
        if fam.ln_mix_unit:
            mix_at, unit = get_path(mod, fam.ln_mix), nn.RMSNorm(w_o.shape[1], eps=float(cfg.rms_norm_eps))
            ln_mix = Norm(unit.requires_grad_(False).to(w_o.device), rms=True)
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
                ln_mix=ln_mix or Norm(get_path(mod, fam.ln_mix), fam.rms, fam.norm_offset),
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
            )
        )
    return Adapter(family=fam, base=base, layers=layers)
