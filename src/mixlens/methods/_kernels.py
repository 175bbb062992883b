"""Compiled inner loops of the norm decomposition (numba): one pass over the tokens and one over the attention maps
of a layer. Both release the GIL and write disjoint parts of their outputs (`_compiled.parallel` spreads the calls
over threads). Their arguments are the named structures below (T = real tokens of the batch, P = probes of the check,
float32 unless said otherwise), built as torch tensors by `norms.block_norms` and passed as plain tuples of numpy
views (`kernel_args`); each kernel names them again on its first line.

For every real target i and source j the attention pass evaluates the two Gram quadratic forms
‖Σ_h α^h_ij F_k^h(x_j)‖² = Σ_{h,h'} α^h_ij α^h'_ij G_k[h, h', j] (k = plain f, LayerNorm-projected f), the head
mean of α and the probe sums Σ_h Σ_j α^h_ij (f^h(x_j)·r_p) of the exactness check. α is read in its natural
[head, target, source] layout, source innermost, so nothing is transposed or materialised per (i, j).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from numba import types
from numba.extending import intrinsic

from mixlens.methods._numba import njit

# A field holds a torch tensor where the structure is built and read (`norms`, `_torch_passes`) and a numpy view
# inside a kernel. Numba supports neither generic NamedTuples nor a union per side, so the fields are typed Any.
Array = Any


def kernel_args(group: NamedTuple) -> tuple:
    """A named structure as the plain tuple of numpy views (CPU tensors only) that a kernel takes: numba types a
    plain tuple of arrays in C but a named tuple in Python, several times slower per call."""
    return tuple(v.numpy() if isinstance(v, torch.Tensor) else v for v in group)


class Layout(NamedTuple):
    """Where the T real tokens of a right-padded [B, n] batch are (int64)."""

    rows: Array  # [T]  row of each real token in the flattened [B·n] layout
    offsets: Array  # [B]  index of (b, 0) among the T real tokens
    lengths: Array  # [B]  real tokens per input
    targets: Array  # [B, K]  positions of the target rows the attention pass computes (all n in full mode)


class LayerInputs(NamedTuple):
    """What the trace gives for one layer."""

    alpha: Array  # [B, H, R, n]  rows of α^h_ij: row alpha_at[b, i] holds target position i (full maps: R = n)
    alpha_at: Array  # [B, n]  int64: the row of `alpha` holding position i (read only at target positions)
    alpha_diag: Array  # [B, H, n]  α^h_ii
    v: Array  # [T, H, d_h]  value vectors v^h_j of the real tokens, token-major (pre-LN: of LN(x_j))
    x: Array  # [B·n, d]  layer input (the residual)
    attn_out: Array  # [B·n, d]  real attention output, b_O included
    mix_in: Array  # [B·n, d]  real input of the norm after attention
    mix_out: Array  # [B·n, d]  real output of that norm


class LayerWeights(NamedTuple):
    """Weight-derived constants of one layer (cached per weight version)."""

    mean_w: Array  # [H, d_h]  row means of W_O^h (empty [0, d_h] for RMSNorm: f is then not centred)
    gamma: Array  # [d]  γ
    gamma2: Array  # [d]  γ²
    beta: Array  # [d]  β (zeros for RMSNorm)
    b_o: Array  # [d]  b_O (zeros without an output bias)
    probes: Array  # [P, d]  random directions r_p of the check (fixed seed per layer)
    w_probe: Array  # [H, P, d_h]  (W_O^h r_p)ᵀ
    eps: float  # the norm's ε
    rms: bool  # RMSNorm: no centring
    identity: bool  # no norm (a parallel block's ln_mix): s_i = 1 (with rms, γ = 1, β = 0: g is the identity)


class TokenResults(NamedTuple):
    """Per-token quantities of every layer of a run (row l: layer l), allocated once per run: written by the token
    pass, read by the attention pass (which writes probe_err)."""

    grams: Array  # compiled: [L, 2, H(H+1)/2, T] packed upper triangles h ≤ h' row-major, off-diagonal entries
    # doubled; torch: full [L, 2, H, H, T]. [:, 0]: f^h·f^h', [:, 1]: P f^h·P f^h' with P f = γ ⊙ C f
    probe_f: Array  # [L, H, P, T]  f^h(x_j)·r_p
    diag: Array  # [L, 2, T]  ‖t_ii‖, ‖P t_ii‖/s_i
    total_r: Array  # [L, T, P]  (attention output − b_O)·r_p
    check: Array  # [L, 2, T]  reconstruction error of the norm input and output; output scale
    probe_err: Array  # [L, T]  max_p |Σ_h Σ_j α^h_ij f^h(x_j)·r_p − total_i·r_p| (0 for rows not computed)


class Maps(NamedTuple):
    """The [batch, layer, ...] outputs of every layer; the kernels write each real cell and never padding."""

    f_norm: Array  # [B, L, H, n(source)]  ‖f^h(x_j)‖
    ratio: Array  # [5, B, L, n(target)]  r_i: W, N, Res-W, Res-N, ResLN-N (RATIO_VARIANTS order)
    scale: Array  # [B, L, n]  s_i
    n: Array  # [B, L, K(target), n(source)]  ‖u_ij‖ (K = n in full mode, else the rows of Layout.targets)
    n_res: Array  # [B, L, K, n]  ‖t_ij‖
    n_resln: Array  # [B, L, K, n]  ‖g_i(t_ij)‖
    alpha_mean: Array  # [B, L, K, n]  head mean of α


def _bitcast(name: str, src: Any, dst: Any) -> Any:
    """A compiled-only function reinterpreting the bits of a `src` scalar as a `dst` scalar."""

    def typer(typingctx: Any, x: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.bitcast(args[0], context.get_value_type(dst))

        return dst(src), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


# max |·| as IEEE bits: non-negative floats order as their bits (NaN above +inf), and an integer max reduction
# vectorises where a float one does not (numba does not mark the kernels no-NaN): 7× → 1× the cost of a sum.
_bits = _bitcast("_bits", types.float32, types.int32)  # float32 → its bits as int32
_float = _bitcast("_float", types.int32, types.float32)  # the inverse


@njit(nogil=True, cache=True, fastmath=True)
def token_pass(
    cf: np.ndarray,
    start: int,
    t0: int,
    t1: int,
    layer: int,
    inputs: tuple,
    weights: tuple,
    layout: tuple,
    results: tuple,
    maps: tuple,
) -> None:  # pragma: no cover - compiled
    """Everything per token of one layer, for tokens start + t0 .. start + t1 - 1 of one block, where cf [H, c, d] =
    C f^h = v^h W_O^h C of the block's tokens start .. start + c - 1. The structures come as plain tuples (see
    `kernel_args`): LayerInputs, LayerWeights, Layout, TokenResults, Maps.

    Writes per token t row `layer` of the fields of TokenResults but probe_err, and at (b, layer, ·, i) of Maps:
    f_norm, ratio, scale.

    With μ^h = v^h·mean(W_O^h): f^h·f^h' = C f^h·C f^h' + d μ^h μ^h'. With total = attention output − b_O and
    u_ii = Σ_h α^h_ii f^h: t_ii = u_ii + x_i and off_i = total − u_ii = Σ_{j≠i} t_ij."""
    inp, wt, where, res, out = (
        LayerInputs(*inputs),
        LayerWeights(*weights),
        Layout(*layout),
        TokenResults(*results),
        Maps(*maps),
    )
    alpha_diag, v, x, attn_out, mix_in, mix_out = inp.alpha_diag, inp.v, inp.x, inp.attn_out, inp.mix_in, inp.mix_out
    mean_w, gamma, gamma2, beta, b_o = wt.mean_w, wt.gamma, wt.gamma2, wt.beta, wt.b_o
    probes, w_probe, rms = wt.probes, wt.w_probe, wt.rms
    grams, probe_f, diag = res.grams[layer], res.probe_f[layer], res.diag[layer]
    total_r, check = res.total_r[layer], res.check[layer]
    rows = where.rows
    heads, d = cf.shape[0], cf.shape[2]
    n = out.f_norm.shape[3]
    n_probes = probes.shape[0]
    zero = np.float32(0.0)
    tiny = np.float32(1e-30)
    fd, eps32 = np.float32(d), np.float32(wt.eps)
    w = np.empty(d, np.float32)
    u = np.empty(d, np.float32)
    mu = np.zeros(heads, np.float32)
    for t in range(t0, t1):
        tt = start + t
        row = rows[tt]
        b = row // n
        i = row % n
        shift = zero
        if mean_w.shape[0]:
            for h in range(heads):
                acc = zero
                for a in range(v.shape[2]):
                    acc += v[tt, h, a] * mean_w[h, a]
                mu[h] = acc
                shift += alpha_diag[b, h, i] * acc
        for k in range(d):
            u[k] = shift
        p = 0
        w_mix = zero
        for h in range(heads):
            fh = cf[h, t]
            ah = alpha_diag[b, h, i]
            w_mix += ah
            s0 = s1 = zero
            for k in range(d):
                fk = fh[k]
                wk = fk * gamma2[k]
                w[k] = wk
                u[k] += ah * fk
                s0 += fk * fk
                s1 += wk * fk
            s0 += fd * mu[h] * mu[h]
            out.f_norm[b, layer, h, i] = np.sqrt(max(s0, zero))
            grams[0, p, tt] = s0
            grams[1, p, tt] = s1
            p += 1
            for h2 in range(h + 1, heads, 2):  # two heads h2 per pass over d: fh and w are loaded once for both
                h3 = min(h2 + 1, heads - 1)  # (the last pass of an odd count computes h2 twice)
                f2, f3 = cf[h2, t], cf[h3, t]
                s0 = s1 = s2 = s3 = zero
                for k in range(d):
                    s0 += fh[k] * f2[k]
                    s1 += w[k] * f2[k]
                    s2 += fh[k] * f3[k]
                    s3 += w[k] * f3[k]
                grams[0, p, tt] = 2 * (s0 + fd * mu[h] * mu[h2])
                grams[1, p, tt] = 2 * s1
                if h3 > h2:
                    grams[0, p + 1, tt] = 2 * (s2 + fd * mu[h] * mu[h3])
                    grams[1, p + 1, tt] = 2 * s3
                p += h3 - h2 + 1
            for q in range(n_probes):
                acc = zero
                for a in range(v.shape[2]):
                    acc += v[tt, h, a] * w_probe[h, q, a]
                probe_f[h, q, tt] = acc
        for q in range(n_probes):
            acc = zero
            for k in range(d):
                acc += (attn_out[row, k] - b_o[k]) * probes[q, k]
            total_r[tt, q] = acc
        sum_in = sum_y = sum_t = sum_o = zero
        tn2 = on2 = un2 = zero
        err_in = top = np.int32(0)  # max |·| as IEEE bits (see `_bits`)
        for k in range(d):
            y = attn_out[row, k] + x[row, k]  # what the norm input must be
            tk = u[k] + x[row, k]
            of = attn_out[row, k] - b_o[k] - u[k]
            sum_in += mix_in[row, k]
            sum_y += y
            sum_t += tk
            sum_o += of
            err_in = max(err_in, _bits(abs(y - mix_in[row, k])))
            top = max(top, _bits(abs(mix_in[row, k])))
            tn2 += tk * tk
            on2 += of * of
            un2 += u[k] * u[k]
        m_in, m_y, m_t, m_o = (zero, zero, zero, zero) if rms else (sum_in / fd, sum_y / fd, sum_t / fd, sum_o / fd)
        var = ptn2 = pon2 = zero
        for k in range(d):
            c = mix_in[row, k] - m_in
            var += c * c
            ct = gamma[k] * (u[k] + x[row, k] - m_t)
            ptn2 += ct * ct
            co = gamma[k] * (attn_out[row, k] - b_o[k] - u[k] - m_o)
            pon2 += co * co
        s = np.float32(1.0) if wt.identity else np.sqrt(var / fd + eps32)
        err_out = np.int32(0)
        for k in range(d):
            r = gamma[k] * (attn_out[row, k] + x[row, k] - m_y) / s + beta[k]
            err_out = max(err_out, _bits(abs(r - mix_out[row, k])))
            top = max(top, _bits(abs(r)))
        tn, on, un, ptn, pon = np.sqrt(tn2), np.sqrt(on2), np.sqrt(un2), np.sqrt(ptn2), np.sqrt(pon2)
        w_mix = 1 - w_mix / heads
        diag[0, tt] = tn
        diag[1, tt] = ptn / s
        check[0, tt] = _float(max(err_in, err_out))
        check[1, tt] = _float(top)
        out.scale[b, layer, i] = s
        out.ratio[0, b, layer, i] = w_mix
        out.ratio[1, b, layer, i] = on / max(on + un, tiny)
        out.ratio[2, b, layer, i] = w_mix / 2
        out.ratio[3, b, layer, i] = on / max(on + tn, tiny)
        out.ratio[4, b, layer, i] = pon / max(pon + ptn, tiny)


@njit(inline="always")
def _pair(h: int, h2: int, heads: int) -> int:  # pragma: no cover - compiled
    """Index of the head pair (h, h2), h ≤ h2, in the packed upper triangle (row-major)."""
    return h * heads - h * (h - 1) // 2 + h2 - h


@njit(nogil=True, cache=True, fastmath=True)
def attention_pass(
    r0: int, r1: int, layer: int, slot: int, causal: bool, inputs: tuple, layout: tuple, results: tuple, maps: tuple
) -> None:  # pragma: no cover - compiled
    """Rows r0 .. r1 - 1 of the flattened [B·K] target rows of one layer (row k of input b is position
    Layout.targets[b, k]), from α and row `layer` of the token pass's TokenResults (the structures as plain tuples:
    LayerInputs, Layout, TokenResults, Maps). Writes the maps n, n_res, n_resln, alpha_mean at [b, `slot`, k] (norms
    square-rooted, N-ResLN divided by s_i from Maps.scale[b, `layer`], the N-Res and N-ResLN diagonals from
    TokenResults.diag) and TokenResults.probe_err. Padded cells are not written. Head pairs go in 2 × 2 blocks (two α
    rows against two, four Gram rows per form per pass over the sources), which quarters the accumulator traffic of
    one pair per pass."""
    inp, where, res, out = LayerInputs(*inputs), Layout(*layout), TokenResults(*results), Maps(*maps)
    alpha, grams, probe_f, diag = inp.alpha, res.grams[layer], res.probe_f[layer], res.diag[layer]
    total_r, probe_err = res.total_r[layer], res.probe_err[layer]
    offsets, lengths, targets = where.offsets, where.lengths, where.targets
    alpha_at = inp.alpha_at
    heads, n, n_rows = alpha.shape[1], alpha.shape[3], targets.shape[1]
    n_probes = probe_f.shape[1]
    zero = np.float32(0.0)
    plain_buf = np.empty(n, np.float32)
    proj_buf = np.empty(n, np.float32)
    mean_buf = np.empty(n, np.float32)
    probed = np.empty(n_probes, np.float32)
    zero_buf = np.zeros(n, np.float32)
    for r in range(r0, r1):
        b = r // n_rows
        row = r % n_rows
        i = targets[b, row]
        m = lengths[b]
        if i >= m:
            continue
        o = offsets[b]
        ai = alpha_at[b, i]
        end = i + 1 if causal else m
        plain = plain_buf[:end]
        proj = proj_buf[:end]
        mean = mean_buf[:end]
        plain[:] = zero
        proj[:] = zero
        mean[:] = zero
        probed[:] = zero
        for a0 in range(0, heads, 2):  # heads in pairs (a0, a1); an odd count's last a1 reads zeros
            two = a0 + 1 < heads
            a1 = a0 + 1 if two else a0
            x = alpha[b, a0, ai, :end]
            y = alpha[b, a1, ai, :end] if two else zero_buf[:end]
            p00, p01, p11 = _pair(a0, a0, heads), _pair(a0, a1, heads), _pair(a1, a1, heads)
            d0, d1, d2 = grams[0, p00, o : o + end], grams[0, p01, o : o + end], grams[0, p11, o : o + end]
            e0, e1, e2 = grams[1, p00, o : o + end], grams[1, p01, o : o + end], grams[1, p11, o : o + end]
            for j in range(end):
                xx = x[j] * x[j]
                xy = x[j] * y[j]
                yy = y[j] * y[j]
                plain[j] += d0[j] * xx + d1[j] * xy + d2[j] * yy
                proj[j] += e0[j] * xx + e1[j] * xy + e2[j] * yy
                mean[j] += x[j] + y[j]
            for c0 in range(a0 + 2, heads, 2):  # the 2 × 2 block (a0, a1) × (c0, c1) of head pairs
                c1 = c0 + 1 if c0 + 1 < heads else c0
                z = alpha[b, c0, ai, :end]
                w = alpha[b, c1, ai, :end] if c0 + 1 < heads else zero_buf[:end]
                q0, q1, q2, q3 = _pair(a0, c0, heads), _pair(a0, c1, heads), _pair(a1, c0, heads), _pair(a1, c1, heads)
                g0, g1, g2, g3 = (
                    grams[0, q0, o : o + end],
                    grams[0, q1, o : o + end],
                    grams[0, q2, o : o + end],
                    grams[0, q3, o : o + end],
                )
                k0, k1, k2, k3 = (
                    grams[1, q0, o : o + end],
                    grams[1, q1, o : o + end],
                    grams[1, q2, o : o + end],
                    grams[1, q3, o : o + end],
                )
                for j in range(end):
                    xz = x[j] * z[j]
                    xw = x[j] * w[j]
                    yz = y[j] * z[j]
                    yw = y[j] * w[j]
                    plain[j] += (g0[j] * xz + g1[j] * xw) + (g2[j] * yz + g3[j] * yw)
                    proj[j] += (k0[j] * xz + k1[j] * xw) + (k2[j] * yz + k3[j] * yw)
        for h in range(heads):
            ah = alpha[b, h, ai, :end]
            for k in range(n_probes):
                fp = probe_f[h, k, o : o + end]
                acc = zero
                for j in range(end):
                    acc += ah[j] * fp[j]
                probed[k] += acc
        inv = 1 / out.scale[b, layer, i]
        for j in range(end):
            v = np.sqrt(max(plain[j], zero))
            out.n[b, slot, row, j] = v
            out.n_res[b, slot, row, j] = v
            out.n_resln[b, slot, row, j] = np.sqrt(max(proj[j], zero)) * inv
            out.alpha_mean[b, slot, row, j] = mean[j] / heads
        t = o + i
        out.n_res[b, slot, row, i] = diag[0, t]
        out.n_resln[b, slot, row, i] = diag[1, t]
        err = zero
        for k in range(n_probes):
            err = max(err, abs(probed[k] - total_r[t, k]))
        probe_err[t] = err
