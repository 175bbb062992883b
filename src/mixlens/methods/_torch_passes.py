"""The plain-torch passes of the norm engine (any device; what runs on GPUs): the same quantities as the compiled
kernels of `_kernels`, from the same named structures, with full Gram matrices [2, H, H, T] and `quad_norms`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mixlens.methods._kernels import Maps, TokenResults

if TYPE_CHECKING:
    from mixlens.methods.norms import LayerState, RealTokens

CHUNK_ELEMENTS = 1 << 20  # floats per block of sources in the quadratic form (bounds memory)


def quad_norms(alpha: torch.Tensor, grams: torch.Tensor) -> torch.Tensor:
    """‖Σ_h α^h_ij F_k^h(x_j)‖ for K linear images at once, from α [B, H, n, n] and the per-source Gram
    matrices G_k[h, h', j] as grams [K, B, H, H, n] → [K, B, n(target), n(source)]. Plain torch (any device):
    α is transposed source-major in blocks so that each source's Gram matrix is one small matmul."""
    k, b, h, _, n_s = grams.shape
    n_t = alpha.shape[2]
    g = grams.permute(1, 4, 0, 2, 3).reshape(b, n_s, k * h, h)  # [B, j, K·H, H]
    out = alpha.new_empty(b, n_s, k, n_t)
    step = max(1, CHUNK_ELEMENTS // max(1, b * (k + 1) * h * n_t))
    for s in range(0, n_s, step):
        a = alpha[..., s : s + step].transpose(-1, -2).contiguous().transpose(1, 2)  # [B, j, H, i]
        ag = torch.matmul(g[:, s : s + step], a).unflatten(2, (k, h))  # [B, j, K, H, i]
        torch.sum(ag.mul_(a.unsqueeze(2)), dim=3, out=out[:, s : s + step])
    return out.clamp_min_(0).sqrt_().permute(2, 0, 3, 1)


def quad_norm(alpha: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """‖Σ_h α^h_ij F^h_j‖ from α [B, H, n, n] and one per-source Gram G_j [B, n, H, H] → [B, n, n]."""
    return quad_norms(alpha, gram.permute(0, 2, 3, 1).unsqueeze(0))[0]


def token_passes(
    layers: list[LayerState], tok: RealTokens, results: TokenResults, maps: Maps, token_block: int
) -> None:
    """Everything per token of every layer: writes each layer's row of `results` and its f_norm, ratio and scale
    in `maps`."""
    for st in layers:
        _token_pass(st, tok, results, maps, token_block)


def _token_pass(st: LayerState, tok: RealTokens, results: TokenResults, maps: Maps, token_block: int) -> None:
    """One layer. C is folded into the weights (W_O^h C; the mean μ^h = v^h·mean(W_O^h) comes back as a rank-one
    term), so P f·P f' = (γ² ⊙ C f)·C f'."""
    inp, wt, cst, index = st.inputs, st.weights, st.weights.consts, st.index
    vh = inp.v.transpose(0, 1)  # [H, T, d_h]
    a_ii = tok.gather(inp.alpha_diag.transpose(0, 1).flatten(1), dim=1)  # [H, T]  α^h_ii
    norm, (h, t_len, _), d = st.layer.ln_mix, vh.shape, wt.w_c.shape[-1]
    raw = vh.new_empty(t_len, h, 2 * h)  # [T, H, 2H] = [C f · C f | C f · γ² C f]
    u_ii = vh.new_empty(t_len, d)
    buf = vh.new_empty(2 * h, min(token_block, t_len), d)
    for s in range(0, t_len, token_block):
        e = min(s + token_block, t_len)
        cf, pf = buf[:h, : e - s], buf[h:, : e - s]
        torch.matmul(vh[:, s:e], wt.w_c, out=cf)  # [H, c, d]
        torch.mul(cf, cst.gamma2, out=pf)
        torch.matmul(cf.transpose(0, 1), buf[:, : e - s].permute(1, 2, 0), out=raw[s:e])
        torch.sum(cf.mul_(a_ii[:, s:e, None]), dim=0, out=u_ii[s:e])  # Σ_h α_ii C f (clobbers cf)
    grams = results.grams[index]  # [2, H, H, T]
    grams.copy_(raw.view(t_len, h, 2, h).permute(2, 1, 3, 0))
    if not cst.rms:
        mu = torch.matmul(cst.mean_w[:, None], vh.transpose(1, 2))[:, 0]  # [H, T] mean of f^h over the hidden axis
        grams[0].add_(mu[:, None] * mu[None, :], alpha=d)
        u_ii += (a_ii * mu).sum(0)[:, None]
    f_norm = grams[0].diagonal(dim1=0, dim2=1).clamp_min(0).sqrt()  # [T, H]

    x, attn_out, mix_in, mix_out = (tok.gather(t) for t in (inp.x, inp.attn_out, inp.mix_in, inp.mix_out))
    total = attn_out - cst.b_o
    t_ii, off = u_ii + x, total - u_ii
    s_i = norm.scale(mix_in)  # [T]
    y = attn_out + x
    rebuilt = norm.project(y) / s_i[:, None] + cst.beta
    tn, ptn, on, un, pon = (v.norm(dim=-1) for v in (t_ii, norm.project(t_ii), off, u_ii, norm.project(off)))

    def r(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a / (a + b).clamp_min(1e-30)

    w_mix = 1 - a_ii.mean(0)
    ratios = torch.stack([w_mix, r(on, un), w_mix / 2, r(on, tn), r(pon, ptn)], -1)  # [T, 5] in RATIO_VARIANTS order
    maps.f_norm[:, index] = tok.scatter(f_norm).transpose(1, 2)
    maps.ratio[:, :, index] = tok.scatter(ratios).permute(2, 0, 1)
    maps.scale[:, index] = tok.scatter(s_i)
    err = torch.maximum((y - mix_in).abs().amax(-1), (rebuilt - mix_out).abs().amax(-1))
    top = torch.maximum(mix_in.abs().amax(-1), rebuilt.abs().amax(-1))
    torch.matmul(cst.w_probe, vh.transpose(1, 2), out=results.probe_f[index])
    torch.stack([tn, ptn / s_i], out=results.diag[index])
    torch.matmul(total, cst.probes.T, out=results.total_r[index])
    torch.stack([err, top], out=results.check[index])


def attention_passes(
    layers: list[LayerState], tok: RealTokens, results: TokenResults, maps: Maps, slot: int | None = None
) -> None:
    """The per-(target, source) part of every layer: writes n, n_res, n_resln and alpha_mean of `maps` (the target
    rows of `tok.layout.targets`, at each layer's index or at `slot`) and the layer's row of `results.probe_err`
    (of those rows; other tokens 0)."""
    mask, (offsets, lengths, targets) = tok.mask, tok.layout[1:]
    rows = None if tok.all_rows else targets
    mask_t = mask if rows is None else mask.gather(1, rows)  # [B, K] real target rows
    pair = (mask_t[:, :, None] & mask[:, None, :]).float()
    pair_maps = (maps.n, maps.n_res, maps.n_resln, maps.alpha_mean)
    for st in layers:
        alpha, at = st.inputs.alpha, st.index if slot is None else slot
        res = TokenResults(*(r[st.index] for r in results))
        b, h, _, n = alpha.shape
        if rows is not None:
            held = st.inputs.alpha_at.gather(1, rows).clamp_min(0)  # rows of α holding the targets (padding: any)
            alpha = alpha.gather(2, held[:, None, :, None].expand(b, h, rows.shape[1], n))  # [B, H, K, n]
        full = res.grams.new_zeros(2, b, h, h, n)
        for k in range(b):  # back to the padded layout of the batch
            o, m = int(offsets[k]), int(lengths[k])
            full[:, k, :, :, :m] = res.grams[..., o : o + m]
        n_n, n_resln = quad_norms(alpha, full) * pair
        scale = maps.scale[:, st.index] if rows is None else maps.scale[:, st.index].gather(1, rows)
        inv_s = torch.where(mask_t, 1 / scale, 0)  # [B, K]
        for m, v in zip(pair_maps, (n_n, n_n, n_resln * inv_s[:, :, None], alpha.mean(1) * pair), strict=True):
            m[:, at] = v
        for m, v in zip(pair_maps[1:3], res.diag, strict=True):  # t_ii at (row k, source targets[k])
            d = tok.scatter(v).gather(1, targets) * mask_t
            m[:, at].scatter_(2, targets[:, :, None], d[:, :, None])
        fp = tok.scatter(res.probe_f.permute(2, 0, 1)).permute(0, 2, 1, 3)  # [B, H, n, P]
        err = (
            (
                torch.matmul(alpha, fp).sum(1)
                - tok.scatter(res.total_r).gather(1, targets[:, :, None].expand(-1, -1, res.total_r.shape[1]))
            )
            .abs()
            .amax(-1)
        )  # [B, K]
        if rows is None:
            res.probe_err.copy_(tok.gather(err.flatten()))
        else:
            res.probe_err.zero_()
            real = mask_t.flatten()
            res.probe_err[(offsets[:, None] + targets).flatten()[real]] = err.flatten()[real]
