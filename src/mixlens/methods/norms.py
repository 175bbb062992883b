"""Norm-based decomposition of the attention block (Kobayashi et al. 2020, 2021; DESIGN §3.2–3.4).

Per layer, with f^h(x_j) = v^h_j W_O^h and u_ij = Σ_h α^h_ij f^h(x_j):

- N       ‖α^h_ij f^h(x_j)‖ per head, ‖u_ij‖ head-summed
- N-Res   ‖t_ij‖,        t_ij = u_ij + [i=j] x_i
- N-ResLN ‖g_i(t_ij)‖,   g_i(v) = γ ⊙ C(v) / s_i, s_i from the real pre-norm vector

Norms of linear images are taken through per-source Gram matrices (DESIGN §4), never through
[head, target, source, d] tensors. Every call checks that the decomposition sums back to the real
pre-norm vector and norm output of each layer, and raises `ReconstructionError` naming the layer if not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixlens.adapters import Layer
from mixlens.errors import ReconstructionError
from mixlens.methods.registry import LHTS, register
from mixlens.trace import LayerTrace, Trace, _repeat_kv

RATIO_VARIANTS = ("W", "N", "Res-W", "Res-N", "ResLN-N")
TOLERANCE = 1e-4  # max abs error, relative to max(1, |real output|)
PROBES = 4  # random directions of the per-run decomposition check
CHUNK_ELEMENTS = 1 << 20  # floats per block of target rows in the Gram quadratic form (bounds memory)


@dataclass
class BlockNorms:
    """All norm-based quantities of a trace. B=batch, L=layer, H=head, n=tokens, d=hidden."""

    f_norm: torch.Tensor  # [B, L, H, n(source)]  ‖f^h(x_j)‖
    n: torch.Tensor  # [B, L, n, n]  ‖u_ij‖
    n_res: torch.Tensor  # [B, L, n, n]  ‖t_ij‖
    n_resln: torch.Tensor  # [B, L, n, n]  ‖g_i(t_ij)‖
    ratio: dict[str, torch.Tensor]  # variant → [B, L, n(target)] context-mixing ratio r_i
    bias: torch.Tensor  # [B, L, n, d]  g_i(b_O) + β, the part of the norm output no token owns
    error: torch.Tensor  # [B, L] max abs reconstruction error (pre-norm sum and norm output)


def quad_norms(alpha: torch.Tensor, grams: torch.Tensor) -> torch.Tensor:
    """‖Σ_h α^h_ij F^h_j‖ for K linear images at once, from α [B, H, n, n] and the stacked per-source Gram
    matrices G_j [B, n, H, K·H] (G_j[h, k·H + h'] = F_k^h_j · F_k^h'_j) → [K, B, n(target), n(source)].

    α is laid out source-major ([B, j, i, H], one contiguous copy per block of target rows) so that each
    source's Gram matrix is applied by one small matmul.
    """
    b, h, n_t, n_s = alpha.shape
    k = grams.shape[-1] // h
    out = torch.empty(k, b, n_s, n_t, dtype=alpha.dtype)
    rows = max(1, CHUNK_ELEMENTS // max(1, b * n_s * h * (k + 1)))
    for s in range(0, n_t, rows):
        a = alpha[:, :, s : s + rows].permute(0, 3, 2, 1).contiguous()  # [B, j, i, H]
        ag = torch.matmul(a, grams).unflatten(-1, (k, h))  # [B, j, i, K, H]
        out[:, :, :, s : s + rows] = (ag * a.unsqueeze(3)).sum(-1).permute(3, 0, 1, 2)
    return out.clamp_min_(0).sqrt_().transpose(2, 3)


def quad_norm(alpha: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """‖Σ_h α^h_ij F^h_j‖ from α [B, H, n, n] and one per-source Gram G_j [B, n, H, H] → [B, n, n]."""
    return quad_norms(alpha, gram)[0]


def head_vectors(lt: LayerTrace, lay: Layer) -> torch.Tensor:
    """f^h(x_j) = v^h_j W_O^h for every head and source: [B, H, n, d]."""
    v = _repeat_kv(lt.value, lay.n_heads).float()
    w = lay.w_o.float().reshape(lay.n_heads, lay.d_head, -1)
    return torch.einsum("bhjk,hkd->bhjd", v, w)


def attn_sum(lt: LayerTrace, lay: Layer) -> torch.Tensor:
    """Σ_j Σ_h α^h_ij f^h(x_j) (the attention output without b_O): [B, n, d]."""
    z = torch.matmul(lt.alpha.float(), _repeat_kv(lt.value, lay.n_heads).float())  # [B, H, n, d_h]
    return z.transpose(1, 2).flatten(2) @ lay.w_o.float()


def _layer(lt: LayerTrace, lay: Layer, mask: torch.Tensor, index: int) -> dict[str, torch.Tensor]:
    alpha, x, norm = lt.alpha.float(), lt.x.float(), lay.ln_mix
    b, h, n, _ = alpha.shape
    v = _repeat_kv(lt.value, h).float().transpose(1, 2)  # [B, n, H, d_h]
    f = torch.einsum("bjhk,hkd->bjhd", v, lay.w_o.float().reshape(h, lay.d_head, -1))  # [B, n, H, d]
    # Gram matrices of f and of P f (P = γ ⊙ C) in one matmul: P f·P f' = (γ² ⊙ f)·f' − mean corrections.
    g2 = norm.weight.float().pow(2)
    fg = f * g2
    ft = f.transpose(2, 3)
    raw = torch.cat([torch.matmul(f, ft), torch.matmul(fg, ft)], dim=3)  # [B, n, H, 2H] = [G | (γ²f)·f]
    if not norm.rms:
        mu, c = f.mean(-1), fg.sum(-1)  # [B, n, H]
        raw[..., h:] += mu.unsqueeze(-1) * mu.unsqueeze(-2) * g2.sum() - c.unsqueeze(-1) * mu.unsqueeze(-2) \
            - mu.unsqueeze(-1) * c.unsqueeze(-2)
    a_ii = alpha.diagonal(dim1=2, dim2=3).transpose(1, 2).contiguous()  # [B, n, H]
    u_ii = torch.matmul(a_ii.unsqueeze(2), f).squeeze(2)  # [B, n, d]
    t_ii = u_ii + x
    b_o = lay.b_o.float() if lay.b_o is not None else torch.zeros_like(x[0, 0])
    total = lt.attn_out.float() - b_o  # the real Σ_j Σ_h α^h_ij f^h(x_j)
    off = total - u_ii  # Σ_{j≠i} u_ij = Σ_{j≠i} t_ij
    s = norm.scale(lt.mix_in.float())  # [B, n]

    n_n, n_resln = quad_norms(alpha, raw)
    n_res = n_n.clone()
    n_res.diagonal(dim1=1, dim2=2).copy_(t_ii.norm(dim=-1))
    n_resln /= s[:, :, None]
    n_resln.diagonal(dim1=1, dim2=2).copy_(norm.project(t_ii).norm(dim=-1) / s)

    def r(o: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        on, dn = o.norm(dim=-1), d.norm(dim=-1)
        return on / (on + dn).clamp_min(torch.finfo(on.dtype).tiny)

    w_mix = 1 - a_ii.mean(-1)
    ratio = {"W": w_mix, "N": r(off, u_ii), "Res-W": w_mix / 2, "Res-N": r(off, t_ii),
             "ResLN-N": r(norm.project(off), norm.project(t_ii))}

    bias = norm.project(b_o) / s[..., None] + norm.shift().float()
    error = _check(lt, lay, total, x, b_o, norm.project(total + x) / s[..., None] + bias, mask, index)
    keep = mask.float()
    pair = keep[:, :, None] * keep[:, None, :]
    return {"f_norm": raw[..., :h].diagonal(dim1=2, dim2=3).clamp_min(0).sqrt().transpose(1, 2) * keep[:, None],
            "n": n_n * pair, "n_res": n_res * pair, "n_resln": n_resln * pair, "bias": bias * keep[..., None],
            "error": error, **{f"ratio:{k}": v * keep for k, v in ratio.items()}}


def _check(lt: LayerTrace, lay: Layer, total: torch.Tensor, x: torch.Tensor, b_o: torch.Tensor,
           rebuilt: torch.Tensor, mask: torch.Tensor, index: int) -> torch.Tensor:
    """Per target: the decomposition against the real attention output (along PROBES random directions,
    which detect any nonzero error vector with probability 1), the residual sum against the real norm input,
    and the rebuilt norm output against the real one. Raises naming the layer; returns [B] max abs error."""
    gen = torch.Generator().manual_seed(index)
    d = total.shape[-1]
    probes = torch.randn(d, PROBES, generator=gen) / d**0.5  # [d, k]
    w = (lay.w_o.float() @ probes).reshape(lay.n_heads, lay.d_head, PROBES)  # W_O^h r: [H, d_h, k]
    fp = torch.einsum("bhjc,hck->bhjk", _repeat_kv(lt.value, lay.n_heads).float(), w)  # f^h(x_j)·r
    summed = torch.einsum("bhij,bhjk->bik", lt.alpha.float(), fp)  # [B, n(target), k]
    m = mask[..., None]
    err_dec = ((summed - total @ probes).abs() * m).amax((1, 2))
    err_in = ((total + b_o + x - lt.mix_in.float()).abs() * m).amax((1, 2))
    err_out = ((rebuilt - lt.mix_out.float()).abs() * m).amax((1, 2))
    error = torch.stack([err_dec, err_in, err_out]).amax(0)
    scale = torch.maximum(lt.mix_in.float().abs().amax(), lt.mix_out.float().abs().amax()).clamp_min(1.0)
    if error.max() > TOLERANCE * scale:
        raise ReconstructionError(
            f"layer {index}: the decomposition differs from the real attention-block output by "
            f"{error.max().item():.3g} (tolerance {TOLERANCE * scale.item():.3g}); the adapter for this "
            "architecture does not match the model"
        )
    return error


@torch.no_grad()
def block_norms(trace: Trace) -> BlockNorms:
    """Compute (once per trace, then cached) every norm-based quantity of every layer."""
    if "block_norms" not in trace.cache:
        per = [_layer(lt, lay, trace.mask, i) for i, (lt, lay) in
               enumerate(zip(trace.layers, trace.adapter.layers, strict=True))]
        st = {k: torch.stack([p[k] for p in per], dim=1) for k in per[0]}
        trace.cache["block_norms"] = BlockNorms(
            f_norm=st["f_norm"], n=st["n"], n_res=st["n_res"], n_resln=st["n_resln"], bias=st["bias"],
            error=st["error"], ratio={v: st[f"ratio:{v}"] for v in RATIO_VARIANTS},
        )
    return trace.cache["block_norms"]


@register("norm", head_dims=LHTS)
def norm(trace: Trace, *, heads: bool = False) -> torch.Tensor:
    """‖α f(x)‖ (Kobayashi 2020): per head α^h_ij‖f^h(x_j)‖, or ‖Σ_h α^h_ij f^h(x_j)‖ head-summed."""
    bn = block_norms(trace)
    if not heads:
        return bn.n
    alpha = torch.stack([lt.alpha for lt in trace.layers], dim=1).float()
    return alpha * bn.f_norm[:, :, :, None, :] * trace.mask[:, None, None, :, None]


@register("norm_res")
def norm_res(trace: Trace) -> torch.Tensor:
    """‖t_ij‖: attention plus residual (Kobayashi 2021, N-Res)."""
    return block_norms(trace).n_res


@register("norm_resln")
def norm_resln(trace: Trace) -> torch.Tensor:
    """‖g_i(t_ij)‖: attention, residual and LayerNorm (Kobayashi 2021, N-ResLN)."""
    return block_norms(trace).n_resln
