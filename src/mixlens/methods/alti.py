"""ALTI (Ferrando et al. 2022; docs/DESIGN.md §3.5): L1-distance contributions per layer and their rollout.

Post-LN: T_i(x_j) = g_i(t_ij) = P1(t_ij)/s1_i and y_i = the real LN1 output, so y_i = Σ_j T_i(x_j) + g_i(b_O) + β
exactly. Pre-LN (GPT-2, Llama): the residual path has no norm, so T_i(x_j) = t_ij and y_i = the real residual sum
x_i + attention output. Contribution c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), rows normalised to 1.
The L1 rule needs the vectors T_i(x_j) (no Gram shortcut): on the CPU a compiled kernel builds each one in a buffer
of d floats and reduces it at once; elsewhere torch builds them in chunks of target rows to bound memory. A causal
row's sources after its target contribute 0 and are skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mixlens.adapters import Layer
from mixlens.methods import norms
from mixlens.methods.attention import targets_of
from mixlens.methods.engine import head_vectors, njit, parallel
from mixlens.methods.memo import memo_of
from mixlens.methods.registry import register, vector_block
from mixlens.methods.rollout import (
    kept_matrices,
    pair_mask,
    rollout,
    rollout_rows,
    row_normalize,
    row_pair_mask,
)
from mixlens.trace import LayerTrace, Trace, repeat_kv

ROW_CHUNK_ELEMENTS = 1 << 20  # torch: floats of T vectors held at once (4 MB: the chunk stays in cache)
ROW_BLOCK = 32  # compiled: target rows per kernel call (they share each source's head vectors in cache)


def _maps(lt: LayerTrace, lay: Layer, pre_ln: bool):
    """(linear map P on [..., d], per-target 1/s [B, n], the real y [B, n, d])."""
    if pre_ln:
        return (lambda v: v), torch.ones(lt.x.shape[:2]), lt.mix_in.float()
    norm = lay.ln_mix
    return norm.project, 1.0 / norm.scale(lt.mix_in.float()), lt.mix_out.float()


@torch.no_grad()
def alti_vectors(trace: Trace, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T [B, n(target), n(source), d], y [B, n, d]) of one layer, all n² vectors at once (for checks and
    small inputs); Σ_j T_i(x_j) plus the bias g_i(b_O) + β (post-LN) or b_O (pre-LN) equals y_i."""
    lt, lay = trace.layers[index], trace.adapter.layers[index]
    p, inv, y = _maps(lt, lay, trace.adapter.family.pre_ln)
    t = torch.einsum("bhij,bhjd->bijd", lt.alpha.float(), p(head_vectors(lt, lay)))
    t.diagonal(dim1=1, dim2=2).add_(p(lt.x.float()).transpose(1, 2))
    return t * inv[:, :, None, None], y


def projected_head_vectors(lt: LayerTrace, lay: Layer, p) -> torch.Tensor:
    """P f^h(x_j) for a linear map P on the hidden axis: [B, H, n, d]. P is applied to the rows of W_O
    (P(v W_O) = v P(W_O)) instead of to the B·H·n vectors."""
    v = repeat_kv(lt.value, lay.n_heads).float()
    w = p(lay.w_o.float()).reshape(lay.n_heads, lay.d_head, -1)
    return torch.einsum("bhjk,hkd->bhjd", v, w)


@njit(nogil=True, cache=True, fastmath=True)
def _l1_rows(
    k0: int,
    k1: int,
    alpha: np.ndarray,
    pf: np.ndarray,
    px: np.ndarray,
    y: np.ndarray,
    rows: np.ndarray,
    ends: np.ndarray,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """Target rows k0 .. k1 − 1 of one input: out[k, j] = max(0, ‖y_k‖₁ − ‖y_k − T_k(x_j)‖₁) for sources j < ends[k],
    T_k(x_j) = Σ_h alpha[h, k, j] pf[h, j] (+ px[k] at j = rows[k]); alpha [H, K, n], pf [H, n, d], px and y [K, d].
    Sources outer, the block's targets inner: the H · d floats of a source's head vectors are read from memory once
    per block and stay in cache; the d-vector of one pair is built and L1-reduced in a buffer of d floats."""
    heads, d = pf.shape[0], pf.shape[2]
    tmp = np.empty(d, np.float32)
    y1 = np.empty(k1 - k0, np.float32)
    for k in range(k0, k1):
        acc = np.float32(0.0)
        for e in range(d):
            acc += abs(y[k, e])
        y1[k - k0] = acc
    for j in range(ends[k0:k1].max()):
        for k in range(k0, k1):
            if j >= ends[k]:
                continue
            for e in range(d):
                tmp[e] = y[k, e]
            for h in range(heads):
                a = alpha[h, k, j]
                if a != 0:
                    for e in range(d):
                        tmp[e] -= a * pf[h, j, e]
            if j == rows[k]:
                for e in range(d):
                    tmp[e] -= px[k, e]
            acc = np.float32(0.0)
            for e in range(d):
                acc += abs(tmp[e])
            out[k, j] = max(y1[k - k0] - acc, np.float32(0.0))


def _example(
    alpha: torch.Tensor, pf: torch.Tensor, px: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, causal: bool
) -> torch.Tensor:
    """ALTI rows of one input (real tokens only) at target positions rows [K]. alpha [H, K, n] (those rows of α,
    already scaled by 1/s_i), pf [H, n, d], px [n, d] (scaled), y [n, d] → c [K(target), n(source)]. A causal row
    skips the sources after its target (α = 0 there, so T = 0 and c = 0). CPU: the compiled kernel `_l1_rows` on
    blocks of `ROW_BLOCK` rows over torch's threads; else torch, in chunks of `ROW_CHUNK_ELEMENTS` floats."""
    h, k, n = alpha.shape
    d = y.shape[-1]
    ends = rows + 1 if causal else torch.full_like(rows, n)
    if norms.COMPILED and alpha.device.type == "cpu":
        out = torch.zeros(k, n)
        args = [t.detach().float().contiguous().numpy() for t in (alpha, pf, px[rows], y[rows])]
        args += [rows.contiguous().numpy(), ends.contiguous().numpy(), out.numpy()]
        parallel([(_l1_rows, s, min(k, s + ROW_BLOCK), *args) for s in range(0, k, ROW_BLOCK)])
        return out
    a = alpha.permute(2, 1, 0)  # [j, K, H]
    pfj = pf.transpose(0, 1)  # [j, H, d]
    out = torch.zeros(k, n)
    step = max(1, ROW_CHUNK_ELEMENTS // (n * d))
    for s in range(0, k, step):
        r = slice(s, min(k, s + step))
        pos, end = rows[r], int(ends[r].max())
        t = torch.matmul(a[:end, r], pfj[:end])  # [j, r, d]: Σ_h α^h_ij P f^h_j / s_i for targets i in r
        t[pos, torch.arange(len(pos))] += px[pos]
        dist = torch.linalg.vector_norm(t.sub_(y[pos]), ord=1, dim=-1)  # ‖y_i − T_i(x_j)‖₁  [j, r]
        out[r, :end] = (y[pos].abs().sum(-1)[None] - dist).clamp_min_(0).T
    return out


def layer_fn(lt: LayerTrace, lay: Layer, pre_ln: bool, mask: torch.Tensor, causal: bool) -> Callable[..., torch.Tensor]:
    """ALTI contributions of one layer, rows normalised, as a function of target positions rows [B, K] → [B, K, n]
    (None: every row, [B, n, n]); padding 0. The function's optional second argument is α at those rows
    [B, H, K, n] when the caller already has them (row mode: they are rebuilt from q and K)."""
    p, inv, y = _maps(lt, lay, pre_ln)
    pf = projected_head_vectors(lt, lay, p)  # [B, H, n, d]
    px = p(lt.x.float()) * inv[..., None]
    b, n, _ = y.shape
    lengths = mask.sum(-1).tolist()

    def rows_of(rows: torch.Tensor | None, alpha_rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is None:
            alpha = lt.alpha.float() * inv[:, None, :, None]
            out = torch.zeros(b, n, n)
            for k, m in enumerate(lengths):  # real tokens only: no work on padding
                out[k, :m, :m] = _example(
                    alpha[k, :, :m, :m], pf[k, :, :m], px[k, :m], y[k, :m], torch.arange(m), causal
                )
            return row_normalize(out * pair_mask(mask)[:, 0])
        alpha = lt.alpha_rows(rows) if alpha_rows is None else alpha_rows.clone()  # [B, H, K, n], scaled in place
        alpha.mul_(inv.gather(1, rows)[:, None, :, None])
        out = torch.zeros(b, rows.shape[1], n)
        for k, m in enumerate(lengths):
            real = rows[k] < m
            if bool(real.all()):  # every row a real token (one input, or its longest): views, no copies
                out[k, :, :m] = _example(alpha[k, :, :, :m], pf[k, :, :m], px[k, :m], y[k, :m], rows[k], causal)
            elif real.any():
                out[k, real, :m] = _example(
                    alpha[k, :, real, :m], pf[k, :, :m], px[k, :m], y[k, :m], rows[k, real], causal
                )
        return row_normalize(out.mul_(row_pair_mask(mask, rows)))

    return rows_of


def _trace_layer(trace: Trace, m: int) -> Callable[[torch.Tensor | None], torch.Tensor]:
    """`layer_fn` of layer m of a (not streamed) trace."""
    fam = trace.adapter.family
    return layer_fn(trace.layers[m], trace.adapter.layers[m], fam.pre_ln, trace.mask, fam.causal)


def alti_matrices(trace: Trace) -> torch.Tensor:
    """Per-layer ALTI contributions, rows normalised: [B, L, n, n], or their target rows [B, L, K, n] in target-row
    mode (cached on the trace)."""
    memo = memo_of(trace)
    if memo.alti is None:
        targets = targets_of(trace)
        kept, mats = memo.layer_rows.get("alti"), kept_matrices(trace, "alti")
        if kept is not None:  # streamed
            memo.alti = torch.stack(kept, dim=1)
        elif mats is not None and targets is not None:
            memo.alti = torch.stack([mats(m)(targets) for m in range(len(trace.layers))], dim=1)
        else:
            memo.alti = torch.stack([_trace_layer(trace, m)(targets) for m in range(len(trace.layers))], dim=1)
    return memo.alti


@register("alti", supports=vector_block, target_rows=True)
def alti(trace: Trace) -> torch.Tensor:
    """ALTI per layer (Ferrando 2022): max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), rows normalised."""
    return alti_matrices(trace)


@register("alti_rollout", supports=vector_block, target_rows=True, explains=True)
def alti_rollout(trace: Trace) -> torch.Tensor:
    """ALTI global attribution: rollout of the per-layer ALTI matrices over layers 1..l."""
    targets = targets_of(trace)
    if targets is not None:
        return rollout_rows(trace, kept_matrices(trace, "alti") or (lambda m: _trace_layer(trace, m)), targets)
    return rollout(alti_matrices(trace))
