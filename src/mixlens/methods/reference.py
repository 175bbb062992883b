"""Executable reference definition of the norm decomposition (Kobayashi et al. 2020, 2021; DESIGN §3.2–3.4).

Explicit vectors in plain torch, readable top to bottom and slow by design: O(H n² d) memory per layer, so for one
small trace only. Every quantity is named after the paper. The fast engine (`norms.block_norms`, Gram matrices and
compiled kernels) must give the same numbers; the tests hold the engine to this file, and this file to the model's
own module outputs (`error`).

Per layer, from the layer input x_j, the attention weights α^h_ij and the adapter's weights (nothing else of the
trace):
  f^h(x_j) = (x_j W_V^h + b_V^h) W_O^h                (pre-LN: of LN(x_j); GQA: value heads shared)
  u_ij     = Σ_h α^h_ij f^h(x_j)                      (the attention part of the pair i ← j)
  t_ij     = u_ij + [i=j] x_i                         (with the residual)
  y_i      = Σ_j t_ij + b_O                            (the pre-norm vector)
  g_i(v)   = γ ⊙ C(v) / s_i, s_i = scale of y_i        (LayerNorm: C centres; RMSNorm: C = identity, s = RMS)
  norm(y_i) = Σ_j g_i(t_ij) + g_i(b_O) + β             (exactly; the bias term is owned by no token)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mixlens.adapters import Layer
from mixlens.methods.engine import RATIO_VARIANTS
from mixlens.trace import LayerTrace, Trace


@dataclass
class ReferenceNorms:
    """Every quantity of the norm decomposition of a trace, as explicit vectors. B=batch, L=layer, H=head,
    n=tokens, d=hidden; axis order [batch, layer, (head,) target, source, (d)]; padded tokens are 0."""

    f: torch.Tensor  # [B, L, H, n(source), d]  f^h(x_j)
    u: torch.Tensor  # [B, L, n, n, d]  u_ij = Σ_h α^h_ij f^h(x_j)
    t: torch.Tensor  # [B, L, n, n, d]  t_ij = u_ij + [i=j] x_i
    y: torch.Tensor  # [B, L, n, d]  pre-norm vector Σ_j t_ij + b_O
    s: torch.Tensor  # [B, L, n]  s_i, the norm's scale of y_i
    g: torch.Tensor  # [B, L, n, n, d]  g_i(t_ij)
    bias: torch.Tensor  # [B, L, n, d]  g_i(b_O) + β
    norm_out: torch.Tensor  # [B, L, n, d]  Σ_j g_i(t_ij) + g_i(b_O) + β
    w: torch.Tensor  # [B, L, H, n, n]  W: α^h_ij
    n_head: torch.Tensor  # [B, L, H, n, n]  N per head: ‖α^h_ij f^h(x_j)‖
    n: torch.Tensor  # [B, L, n, n]  N: ‖u_ij‖
    n_res: torch.Tensor  # [B, L, n, n]  N-Res: ‖t_ij‖
    n_resln: torch.Tensor  # [B, L, n, n]  N-ResLN: ‖g_i(t_ij)‖
    ratio: dict[str, torch.Tensor]  # RATIO_VARIANTS → [B, L, n(target)] context-mixing ratio r_i
    error: torch.Tensor  # [B, L] max abs difference of y and norm_out from the real norm input and output


def value_head_vectors(lt: LayerTrace, lay: Layer, pre_ln: bool) -> torch.Tensor:
    """f^h(x_j) = (x_j W_V^h + b_V^h) W_O^h from the layer input and the weights: [B, H, n(source), d]."""
    x = lt.x.float()  # [B, n, d]
    if pre_ln and lay.ln_in is not None:  # OLMo 2 and ModernBERT's first layer have no norm before the attention
        x = lay.ln_in.module(x)  # the value projection reads LN(x_j)
    b, n, d = x.shape
    v = x @ lay.w_v.float()  # [B, n, H_kv·d_h]
    if lay.b_v is not None:
        v = v + lay.b_v.float()
    v = v.view(b, n, lay.n_kv_heads, lay.d_head).transpose(1, 2)  # [B, H_kv, n, d_h]
    v = v.repeat_interleave(lay.n_heads // lay.n_kv_heads, dim=1)  # [B, H, n, d_h]: head h reads h // (H / H_kv)
    w_o = lay.w_o.float().view(lay.n_heads, lay.d_head, d)  # [H, d_h, d]  W_O^h
    return torch.einsum("bhjk,hkd->bhjd", v, w_o)


def mixing_ratio(v: torch.Tensor) -> torch.Tensor:
    """r_i = ‖Σ_{j≠i} v_ij‖ / (‖Σ_{j≠i} v_ij‖ + ‖v_ii‖) for per-pair vectors v [B, n, n, d] → [B, n]
    (a norm of summed vectors, not a sum of norms)."""
    n = v.shape[1]
    own = v[:, torch.arange(n), torch.arange(n)]  # v_ii  [B, n, d]
    context = v.sum(2) - own  # Σ_{j≠i} v_ij  [B, n, d]
    c, o = context.norm(dim=-1), own.norm(dim=-1)
    return c / (c + o)


def _layer(trace: Trace, index: int) -> ReferenceNorms:
    """All quantities of one layer, without the layer axis ([B, (H,) n, n, (d)])."""
    lt, lay = trace.layers[index], trace.adapter.layers[index]
    norm = lay.ln_mix
    real = trace.mask  # [B, n]
    pair = (real[:, :, None] & real[:, None, :]).float()  # [B, n(target), n(source)]
    x = lt.x.float() * real[..., None]  # [B, n, d]
    n = x.shape[1]
    b_o = lay.b_o.float() if lay.b_o is not None else torch.zeros(x.shape[-1])  # [d]

    alpha = lt.alpha.float() * pair[:, None]  # [B, H, n, n]  α^h_ij
    # sandwich norm (Gemma): the attention output passes γ_post ⊙ v / s^post_i before the residual sum; γ_post is
    # folded into W_O (so into f^h), the per-target 1 / s^post_i scales α
    mix = alpha if lt.post_scale is None else alpha / lt.post_scale.float()[:, None, :, None]  # [B, H, n, n]
    f = value_head_vectors(lt, lay, trace.adapter.family.pre_ln) * real[:, None, :, None]  # [B, H, n, d]
    per_head = mix[..., None] * f[:, :, None]  # [B, H, n, n, d]  α^h_ij f^h(x_j)
    u = per_head.sum(1)  # [B, n, n, d]
    t = u + torch.eye(n)[None, :, :, None] * x[:, :, None, :]  # [B, n, n, d]  + [i=j] x_i
    y = (t.sum(2) + b_o) * real[..., None]  # [B, n, d]
    s = torch.where(real, norm.scale(y), 0)  # [B, n]
    inv_s = torch.where(real, 1 / s, 0)[..., None]  # [B, n, 1]
    g = norm.project(t) * inv_s[..., None]  # [B, n, n, d]  g_i(t_ij)
    bias = (norm.project(b_o) * inv_s + norm.shift().float()) * real[..., None]  # [B, n, d]  g_i(b_O) + β
    norm_out = g.sum(2) + bias  # [B, n, d]

    w_own = 1 - alpha.mean(1).diagonal(dim1=1, dim2=2)  # 1 − ᾱ_ii  [B, n]
    ratio = {"W": w_own, "N": mixing_ratio(u), "Res-W": w_own / 2, "Res-N": mixing_ratio(t), "ResLN-N": mixing_ratio(g)}
    error = torch.maximum((y - lt.mix_in.float()).abs().amax(-1), (norm_out - lt.mix_out.float()).abs().amax(-1))
    return ReferenceNorms(
        f=f,
        u=u,
        t=t,
        y=y,
        s=s,
        g=g,
        bias=bias,
        norm_out=norm_out,
        w=alpha,
        n_head=per_head.norm(dim=-1),
        n=u.norm(dim=-1),
        n_res=t.norm(dim=-1),
        n_resln=g.norm(dim=-1),
        ratio={k: torch.where(real, ratio[k], 0) for k in RATIO_VARIANTS},
        error=torch.where(real, error, 0).amax(-1),
    )


@torch.no_grad()
def decompose(trace: Trace) -> ReferenceNorms:
    """The explicit norm decomposition of every layer of a (small) trace."""
    layers = [_layer(trace, i) for i in range(len(trace.layers))]

    def stack(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(ts, dim=1)  # the layer axis after the batch axis

    names = [f.name for f in fields(ReferenceNorms) if f.name != "ratio"]
    return ReferenceNorms(
        **{name: stack([getattr(lay, name) for lay in layers]) for name in names},
        ratio={k: stack([lay.ratio[k] for lay in layers]) for k in RATIO_VARIANTS},
    )
