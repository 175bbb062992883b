"""ALTI (Ferrando et al. 2022; docs/DESIGN.md §3.5): L1-distance contributions per layer and their rollout.

Post-LN: T_i(x_j) = g_i(t_ij) = P1(t_ij)/s1_i and y_i = the real LN1 output, so y_i = Σ_j T_i(x_j) + g_i(b_O) + β
exactly. Pre-LN (GPT-2, Llama): the residual path has no norm, so T_i(x_j) = t_ij and y_i = the real residual sum
x_i + attention output. Contribution c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), rows normalised to 1.
The L1 rule has no Gram shortcut, but it is linear in T away from the coordinates where T can flip the sign of y: on
the CPU (`_sign_split`) the linear part is one d_h-long dot product per head and pair, and only the few coordinates
with |y_e| below a bound on |T_e| are built; elsewhere torch builds every T_i(x_j) in chunks of target rows to bound
memory. A causal row's sources after its target contribute 0 and are skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mixlens.adapters import Layer
from mixlens.methods import norms
from mixlens.methods.attention import rows_of
from mixlens.methods.engine import head_vectors, njit, parallel
from mixlens.methods.memo import StreamLayer, gathered, memo_of
from mixlens.methods.registry import ROLLOUT_MEMORY, TRACED, Card, Stream, register, vector_block
from mixlens.methods.rollout import (
    kept_matrices,
    pair_mask,
    rollout,
    rollout_rows,
    row_normalize,
    row_pair_mask,
)
from mixlens.trace import LayerTrace, Trace, repeat_kv

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("global.md", "whole-layer and global attribution")

ROW_CHUNK_ELEMENTS = 1 << 20  # torch: floats of T vectors held at once (4 MB: the chunk stays in cache)
ROW_BLOCK = 0  # compiled: target rows per kernel call; 0: split evenly over torch's threads (each block reads P f once)
SPLIT_CHUNK_ELEMENTS = 1 << 22  # `_sign_split`: floats of the [H, rows, n] products held at once (16 MB)
WIDE = 4  # `_l1_split` builds T whole for a pair with over d / WIDE risky coordinates
BOUND_MARGIN = 1e-3  # relative slack on the float32 bound max_e |T_e| ≤ Σ_h α^h max_e |P f^h_j|


def _maps(lt: LayerTrace, lay: Layer, pre_ln: bool):
    """(linear map P on [..., d], per-target 1/s [B, n], the real y [B, n, d])."""
    if pre_ln:
        return (lambda v: v), torch.ones(lt.mix_in.shape[:2]), lt.mix_in.float()
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


def head_factors(lt: LayerTrace, lay: Layer, p) -> tuple[torch.Tensor, torch.Tensor]:
    """(v [B, H, n, d_h], P(W_O^h) [H, d_h, d]) for a linear map P on the hidden axis: P f^h(x_j) = v^h_j P(W_O^h).
    P is applied to the rows of W_O (P(v W_O) = v P(W_O)) instead of to the B·H·n vectors."""
    v = repeat_kv(lt.value, lay.n_heads).float()
    return v, p(lay.w_o.float()).reshape(lay.n_heads, lay.d_head, -1)


def projected_head_vectors(lt: LayerTrace, lay: Layer, p) -> torch.Tensor:
    """P f^h(x_j) for a linear map P on the hidden axis: [B, H, n, d]."""
    v, w = head_factors(lt, lay, p)
    return torch.einsum("bhjk,hkd->bhjd", v, w)


@njit(nogil=True, cache=True, fastmath=True)
def _l1_split(
    k0: int,
    k1: int,
    alpha: np.ndarray,
    g: np.ndarray,
    big: np.ndarray,
    pft: np.ndarray,
    diag: np.ndarray,
    y: np.ndarray,
    order: np.ndarray,
    rows: np.ndarray,
    ends: np.ndarray,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """Target rows k0 .. k1 − 1 of `_sign_split`: out[k, j] = max(0, ‖y_k‖₁ − ‖y_k − T_k(x_j)‖₁) for sources
    j < ends[k], 0 after. Per pair: Σ_e sign(y_e) T_e = Σ_h alpha[h, k, j] g[h, k, j]; the bound
    B = Σ_h alpha[h, k, j] big[h, j] ≥ max_e |T_e|; the risky coordinates, |y_ke| ≤ B (taken in ascending |y_ke|),
    each add δ_e = |y_e − T_e| − |y_e| + sign(y_e) T_e with T_e built from
    pft[j, e] [H]. The self pair j = rows[k] (T has the residual) is diag[k], given. alpha [H, K, n],
    g [H, K, ≥ max ends], big [H, n], pft [n, d, H], diag [K], y [K, d], order [K, d] (positions of |y_k|
    ascending), rows, ends [K], out [K, n]."""
    heads, n = alpha.shape[0], alpha.shape[2]
    d = y.shape[1]
    kb = k1 - k0
    lin = np.zeros((kb, n), np.float32)
    bound = np.zeros((kb, n), np.float32)
    least = np.empty(kb, np.float32)
    wide = np.empty(kb, np.float32)
    norm = np.empty(kb, np.float32)
    av = np.empty(heads, np.float32)
    for r in range(kb):
        k = k0 + r
        for h in range(heads):
            for j in range(ends[k]):
                a = alpha[h, k, j]
                lin[r, j] += a * g[h, k, j]
                bound[r, j] += a * big[h, j]
        least[r] = abs(y[k, order[k, 0]])
        wide[r] = abs(y[k, order[k, d // WIDE]])
        norm[r] = np.abs(y[k]).sum()
        for j in range(ends[k]):  # exact unless the pair has a risky coordinate (fixed below)
            out[k, j] = max(lin[r, j], np.float32(0.0))
        for j in range(ends[k], n):
            out[k, j] = np.float32(0.0)
    for j in range(ends[k0:k1].max()):  # sources outer: P f_j's H · d floats stay in cache for the block's rows
        for r in range(kb):
            k = k0 + r
            b = bound[r, j]
            if j >= ends[k] or (b < least[r] and j != rows[k]):  # no risky coordinate: the linear part is exact
                continue
            if j == rows[k]:  # the self pair, T with the residual: given
                out[k, j] = max(diag[k], np.float32(0.0))
                continue
            for h in range(heads):
                av[h] = alpha[h, k, j]
            if b >= wide[r]:  # many risky coordinates: build T whole
                dist = np.float32(0.0)
                for e in range(d):
                    t = np.float32(0.0)
                    for h in range(heads):
                        t += av[h] * pft[j, e, h]
                    dist += abs(y[k, e] - t)
                out[k, j] = max(norm[r] - dist, np.float32(0.0))
                continue
            c = lin[r, j]
            for i in range(d):
                e = order[k, i]
                ye = y[k, e]
                if abs(ye) > b:
                    break
                t = np.float32(0.0)
                for h in range(heads):
                    t += av[h] * pft[j, e, h]
                c -= abs(ye - t) - abs(ye) + np.sign(ye) * t
            out[k, j] = max(c, np.float32(0.0))


def _ascending(y: np.ndarray) -> np.ndarray:
    """Positions of each row of |y| [K, d] in ascending order [K, d] (int64): numpy's sort of (bits of |y|, position)
    keys (the bits of a non-negative float32 order as it does)."""
    keys = (np.abs(y).view(np.int32).astype(np.int64) << 20) | np.arange(y.shape[1])
    keys.sort(axis=1)
    return keys & ((1 << 20) - 1)


@torch.no_grad()
def _sign_split(
    alpha: torch.Tensor,
    pft: torch.Tensor,
    big: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    diag: torch.Tensor,
    y: torch.Tensor,
    rows: torch.Tensor,
    ends: torch.Tensor,
) -> torch.Tensor:
    """c [K, n] of `_example` on the CPU, exactly, with the L1 norm split at the sign of y (docs/DESIGN.md §3.5):
    ‖y‖₁ − ‖y − T‖₁ = Σ_e sign(y_e) T_e − Σ_{e ∈ R} δ_e, δ_e = |y_e − T_e| − |y_e| + sign(y_e) T_e, where δ_e = 0 unless
    T_e flips or zeroes y_e, which needs |y_e| ≤ |T_e| ≤ B = Σ_h α^h max_e |P f^h_j|_e; so R = {e : |y_e| ≤ B}.
    The first sum is linear in T: Σ_h α^h (P(W_O^h) sign(y)) · v^h_j, a d_h-long dot product per head (the cost of
    attention scores) instead of building the d-long T (H · d per pair). Only R's coordinates are built, by the
    compiled `_l1_split` (few: |y_e| ≤ B is rare unless α^h or the head vector is large). On rows of real decoders
    its kernel handles 3–5× the pairs per second of one that builds T, within 2e-6 (relative) of float64.
    alpha [H, K, n] (scaled), pft [n, d, H] (P f^h_j, heads last), big [H, n] ≥ max_e |P f^h_j|_e, v [H, n, d_h] and
    w [H, d_h, d] (P f^h_j = v^h_j w^h), diag [K] (the self pairs' c, `self_contributions`) and y [K, d] at the
    rows."""
    heads, k, n = alpha.shape
    out = torch.empty(k, n)
    order = _ascending(y.numpy())
    step = max(1, SPLIT_CHUNK_ELEMENTS // (heads * n))
    threads = max(1, torch.get_num_threads())
    for s in range(0, k, step):  # a chunk of rows: its linear terms g, then the kernel over its rows in blocks
        r = slice(s, min(k, s + step))
        end = int(ends[r].max())
        u = torch.einsum("hcd,kd->hkc", w, torch.sign(y[r]))  # [H, k', d_h]
        g = torch.bmm(u, v[:, :end].transpose(1, 2))  # [H, k', end]: sign(y_k) · P f^h_j
        args = [t.contiguous().numpy() for t in (alpha[:, r], g, big, pft, diag[r], y[r])] + [order[r]]
        args += [t.contiguous().numpy() for t in (rows[r], ends[r], out[r])]
        kc = r.stop - r.start
        block = ROW_BLOCK or -(-kc // threads)
        parallel([(_l1_split, b, min(kc, b + block), *args) for b in range(0, kc, block)])
    return out


def _splits(t: torch.Tensor) -> bool:
    """Whether ALTI of tensors like t runs `_sign_split` (the compiled CPU path)."""
    return norms.COMPILED and t.device.type == "cpu"


def _example(
    alpha: torch.Tensor,
    pf: torch.Tensor,
    big: torch.Tensor | None,
    v: torch.Tensor,
    w: torch.Tensor,
    diag: torch.Tensor,
    y: torch.Tensor,
    rows: torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    """ALTI rows of one input (real tokens only) at target positions rows [K]. alpha [H, K, n] (those rows of α,
    already scaled by 1/s_i), pf = P f^h(x_j) = v [H, n, d_h] w [H, d_h, d], heads last [n, d, H] where `_splits`
    else [H, n, d]; big [H, n] ≥ max_e |P f^h_j|_e (`_splits`; else None); diag [n] (c_ii, `self_contributions`),
    y [n, d] → c [K(target), n(source)]. A causal row skips the sources after its target (α = 0 there, so T = 0 and
    c = 0). CPU: `_sign_split`; else torch builds every T vector, in chunks of `ROW_CHUNK_ELEMENTS` floats."""
    h, k, n = alpha.shape
    d = y.shape[-1]
    ends = rows + 1 if causal else torch.full_like(rows, n)
    if _splits(alpha):
        assert big is not None
        return _sign_split(alpha.float(), pf, big, v, w, diag[rows], y[rows], rows, ends)
    a = alpha.permute(2, 1, 0)  # [j, K, H]
    pfj = pf.transpose(0, 1)  # [j, H, d]
    out = torch.zeros(k, n, device=alpha.device)
    step = max(1, ROW_CHUNK_ELEMENTS // (n * d))
    for s in range(0, k, step):
        r = slice(s, min(k, s + step))
        pos, end = rows[r], int(ends[r].max())
        t = torch.matmul(a[:end, r], pfj[:end])  # [j, r, d]: Σ_h α^h_ij P f^h_j / s_i for targets i in r
        dist = torch.linalg.vector_norm(t.sub_(y[pos]), ord=1, dim=-1)  # ‖y_i − T_i(x_j)‖₁  [j, r]
        out[r, :end] = (y[pos].abs().sum(-1)[None] - dist).clamp_min_(0).T
        out[torch.arange(r.start, r.stop), pos] = diag[pos].clamp_min(0)  # the self pairs (T with the residual)
    return out


def self_contributions(lt: LayerTrace, lay: Layer, pre_ln: bool) -> torch.Tensor:
    """ALTI's self pairs before normalisation, c_ii = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_i)‖₁) with T_i(x_i) =
    Σ_h α^h_ii P f^h_i / s_i + P x_i / s_i (the residual): [B, n]. Needs x (a row-mode stream computes them while the
    layer runs and keeps them instead of x)."""
    p, inv, y = _maps(lt, lay, pre_ln)
    return _self_pairs(lt, p, inv, y, *(t.detach() for t in head_factors(lt, lay, p)))


def _self_pairs(
    lt: LayerTrace, p, inv: torch.Tensor, y: torch.Tensor, v: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """`self_contributions` from the layer's maps (`_maps`) and head factors (`head_factors`), already at hand."""
    a = lt.alpha_diagonal() * inv[:, None, :]  # [B, H, n]
    t = torch.einsum("bhnc,hcd->bnd", v * a[..., None], w).add_(p(lt.x.float()) * inv[..., None])
    return (y.abs().sum(-1) - (y - t).abs().sum(-1)).clamp_min_(0)


def layer_fn(
    lt: LayerTrace,
    lay: Layer,
    pre_ln: bool,
    mask: torch.Tensor,
    causal: bool,
    diag: torch.Tensor | None = None,
) -> Callable[..., torch.Tensor]:
    """ALTI contributions of one layer, rows normalised, as a function of target positions rows [B, K] → [B, K, n]
    (None: every row, [B, n, n]); padding 0. The function's optional second argument is α at those rows
    [B, H, K, n] when the caller already has them (row mode: they are rebuilt from q and K). `diag`: the self pairs
    [B, n] (`self_contributions`), for a layer trace kept without x; else computed here."""
    p, inv, y = _maps(lt, lay, pre_ln)
    v, w = (t.detach() for t in head_factors(lt, lay, p))  # [B, H, n, d_h], [H, d_h, d]
    split = _splits(lt.x)
    big = None
    if split:  # P f^h(x_j) heads last [B, n, d, H], one head at a time (no second copy); max_e |P f^h_j|_e [B, H, n]
        pf = torch.empty(*v.shape[:1], v.shape[2], w.shape[2], w.shape[0])
        big = torch.empty(v.shape[:3])
        for h in range(w.shape[0]):
            f = torch.matmul(v[:, h], w[h])  # [B, n, d]
            pf[..., h] = f
            torch.maximum(f.amax(-1), f.amin(-1).neg_(), out=big[:, h])
        big.mul_(1 + BOUND_MARGIN)
    else:
        pf = torch.einsum("bhjk,hkd->bhjd", v, w)  # [B, H, n, d]
    if diag is None:
        diag = _self_pairs(lt, p, inv, y, v, w)
    b, n, _ = y.shape
    lengths = mask.sum(-1).tolist()

    def pf_of(k: int, m: int) -> tuple[torch.Tensor, torch.Tensor | None]:  # input k's first m sources
        return (pf[k, :m], big[k, :, :m]) if big is not None else (pf[k, :, :m], None)

    def rows_of(rows: torch.Tensor | None, alpha_rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is None:
            alpha = lt.alpha.float() * inv[:, None, :, None]
            out = torch.zeros(b, n, n)
            for k, m in enumerate(lengths):  # real tokens only: no work on padding
                out[k, :m, :m] = _example(
                    alpha[k, :, :m, :m],
                    *pf_of(k, m),
                    v[k, :, :m],
                    w,
                    diag[k, :m],
                    y[k, :m],
                    torch.arange(m),
                    causal,
                )
            return row_normalize(out * pair_mask(mask)[:, 0])
        alpha = lt.alpha_rows(rows) if alpha_rows is None else alpha_rows.clone()  # [B, H, K, n], scaled in place
        alpha.mul_(inv.gather(1, rows)[:, None, :, None])
        out = torch.zeros(b, rows.shape[1], n)
        for k, m in enumerate(lengths):
            real = rows[k] < m
            if bool(real.all()):  # every row a real token (one input, or its longest): views, no copies
                out[k, :, :m] = _example(
                    alpha[k, :, :, :m],
                    *pf_of(k, m),
                    v[k, :, :m],
                    w,
                    diag[k, :m],
                    y[k, :m],
                    rows[k],
                    causal,
                )
            elif real.any():
                out[k, real, :m] = _example(
                    alpha[k, :, real, :m],
                    *pf_of(k, m),
                    v[k, :, :m],
                    w,
                    diag[k, :m],
                    y[k, :m],
                    rows[k, real],
                    causal,
                )
        return row_normalize(out.mul_(row_pair_mask(mask, rows)))

    return rows_of


def _trace_layer(trace: Trace, m: int) -> Callable[[torch.Tensor | None], torch.Tensor]:
    """`layer_fn` of layer m of a (not streamed) trace."""
    fam = trace.adapter.family
    return layer_fn(trace.layers[m], trace.adapter.layers[m], fam.pre_ln, trace.mask, fam.causal)


ALTI = "alti"  # memo key of the per-layer matrices, and the key of what the layer sink keeps


def alti_matrices(trace: Trace) -> torch.Tensor:
    """Per-layer ALTI contributions, rows normalised: [B, L, n, n], or their target rows [B, L, K, n] in row
    mode (cached on the trace)."""
    memo = memo_of(trace)

    def make() -> torch.Tensor:
        targets = rows_of(trace)
        kept, mats = memo.layer_rows.get(ALTI), kept_matrices(trace, ALTI)
        if kept is not None:  # streamed
            return torch.stack(kept, dim=1)
        if mats is not None and targets is not None:
            return torch.stack([mats(m)(targets) for m in range(len(trace.layers))], dim=1)
        return torch.stack([_trace_layer(trace, m)(targets) for m in range(len(trace.layers))], dim=1)

    return memo.cached(ALTI, make)


def stream_layer(s: StreamLayer, whole: bool) -> None:
    """The layer sink of a streamed trace (`registry.Stream`): this layer's target rows, or for a rollout (`whole`)
    a factory of any rows — the whole matrix, or in row mode what builds its rows later (no x is kept: its one use,
    the self pairs, is computed now)."""
    lay, mask, pre_ln, causal = s.layer, s.mask, s.family.pre_ln, s.family.causal
    if whole and s.row_mode:
        small = s.lt.for_rows(alti=True)
        diag = self_contributions(s.lt, lay, pre_ln)
        s.keep_fn(ALTI, lambda: layer_fn(small, lay, pre_ln, mask, causal, diag))
        return
    fn = layer_fn(s.lt, lay, pre_ln, mask, causal)
    if whole:
        s.keep_fn(ALTI, gathered(fn(None)))
    else:
        s.keep(ALTI, fn(s.rows))


@register(
    "alti",
    supports=vector_block,
    row_mode=True,
    stream=Stream(ALTI, stream_layer),
    default_in={"html": 4},
    card=Card(
        definition="c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), rows normalised; T_i(x_j) = g_i(t_ij), y_i the real "
        "LN1 output (pre-LN: t_ij and the residual sum) (Ferrando et al. 2022).",
        passes=TRACED + ".",
        memory="[L, n, n]; with --rows only the requested rows ([L, t, n]); T_i(x_j) built in 4 MB chunks of target "
        "rows (CPU: only the sign-risky coordinates).",
        background=BACKGROUND,
    ),
)
def alti(trace: Trace) -> torch.Tensor:
    """ALTI per layer (Ferrando 2022): max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), rows normalised."""
    return alti_matrices(trace)


@register(
    "alti_rollout",
    supports=vector_block,
    row_mode=True,
    explains=True,
    stream=Stream(ALTI, stream_layer, whole=True),
    card=Card(
        definition="R_l = C_l R_{l−1}, the product of the per-layer ALTI matrices over layers 1..l.",
        passes=TRACED + ".",
        memory=ROLLOUT_MEMORY + ".",
        background=BACKGROUND,
    ),
)
def alti_rollout(trace: Trace) -> torch.Tensor:
    """ALTI global attribution: rollout of the per-layer ALTI matrices over layers 1..l."""
    targets = rows_of(trace)
    if targets is not None:
        return rollout_rows(trace, kept_matrices(trace, ALTI) or (lambda m: _trace_layer(trace, m)), targets)
    return rollout(alti_matrices(trace))
