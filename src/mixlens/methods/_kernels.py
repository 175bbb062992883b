"""Compiled inner loops of the norm decomposition (numba): the per-token Gram pass, the per-token statistics and
one pass over the attention maps of a layer. The passes release the GIL; `parallel` spreads calls over threads.

For every real target i and source j the attention pass evaluates the two Gram quadratic forms
‖Σ_h α^h_ij F_k^h(x_j)‖² = Σ_{h,h'} α^h_ij α^h'_ij G_k[h, h', j] (k = plain f, LayerNorm-projected f), the head
mean of α and the probe sums Σ_h Σ_j α^h_ij (f^h(x_j)·r_p) of the exactness check. α is read in its natural
[head, target, source] layout, source innermost, so nothing is transposed or materialised per (i, j).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit


@njit(nogil=True, cache=True, fastmath=True)
def gram_pass(cf, vh, mean_w, gamma2, a_ii, start, grams, f_norm, u_ii):  # pragma: no cover - compiled
    """Per token of one block: the Gram matrices of f and of P f = γ ⊙ C f, ‖f^h‖ and u_ii = Σ_h α^h_ii f^h(x_i).

    cf [H, c, d]: C f^h = v^h W_O^h C of the block's tokens t = start .. start + c - 1; vh [H, T, d_h]; mean_w
    [H, d_h] row means of W_O^h (empty for RMSNorm: f is then not centred); gamma2 [d]; a_ii [H, T]. Writes
    grams [2, H(H+1)/2, T] (upper triangles h ≤ h' row-major, off-diagonal entries doubled), f_norm [T, H] and
    u_ii [T, d]. The mean μ^h = v^h·mean(W_O^h) comes back as f^h·f^h' = C f^h·C f^h' + d μ^h μ^h'."""
    heads, c, d = cf.shape
    zero = np.float32(0.0)
    fd = np.float32(d)
    w = np.empty(d, np.float32)
    mu = np.zeros(heads, np.float32)
    for t in range(c):
        tt = start + t
        shift = zero
        if mean_w.shape[0]:
            for h in range(heads):
                acc = zero
                for a in range(vh.shape[2]):
                    acc += vh[h, tt, a] * mean_w[h, a]
                mu[h] = acc
                shift += a_ii[h, tt] * acc
        u = u_ii[tt]
        for k in range(d):
            u[k] = shift
        p = 0
        for h in range(heads):
            fh = cf[h, t]
            a = a_ii[h, tt]
            for k in range(d):
                w[k] = fh[k] * gamma2[k]
                u[k] += a * fh[k]
            for h2 in range(h, heads):
                f2 = cf[h2, t]
                s0 = zero
                s1 = zero
                for k in range(d):
                    s0 += fh[k] * f2[k]
                    s1 += w[k] * f2[k]
                s0 += fd * mu[h] * mu[h2]
                if h2 == h:
                    f_norm[tt, h] = np.sqrt(max(s0, zero))
                    grams[0, p, tt] = s0
                    grams[1, p, tt] = s1
                else:
                    grams[0, p, tt] = 2 * s0
                    grams[1, p, tt] = 2 * s1
                p += 1


@njit(nogil=True, cache=True, fastmath=True)
def attention_pass(alpha, grams, probe_f, offsets, lengths, inv_s, causal, layer, r0, r1, n_out, nres_out,
                   resln_out, mean_out, probe_out):  # pragma: no cover - compiled
    """Rows r0 .. r1 - 1 of the flattened [B·n] targets. alpha [B, H, n, n]; grams [2, H(H+1)/2, T] as written by
    `gram_pass`, per real token t = offsets[b] + j; probe_f [H, P, T]; offsets, lengths [B]; inv_s [B, n] (1/s_i);
    outputs [B, L, n, n] at `layer` (norms, already square-rooted; N-ResLN divided by s_i), probe_out [B, n, P].
    Padded cells are not written. Two Gram rows per inner loop halve the accumulator traffic."""
    heads, n = alpha.shape[1], alpha.shape[2]
    probes = probe_f.shape[1]
    zero = np.float32(0.0)
    plain_buf = np.empty(n, np.float32)
    proj_buf = np.empty(n, np.float32)
    mean_buf = np.empty(n, np.float32)
    for r in range(r0, r1):
        b = r // n
        i = r % n
        m = lengths[b]
        if i >= m:
            continue
        o = offsets[b]
        end = i + 1 if causal else m
        plain = plain_buf[:end]
        proj = proj_buf[:end]
        mean = mean_buf[:end]
        plain[:] = zero
        proj[:] = zero
        mean[:] = zero
        p = 0
        for h in range(heads):
            ah = alpha[b, h, i, :end]
            h2 = h
            while h2 + 1 < heads:
                a2 = alpha[b, h2, i, :end]
                a3 = alpha[b, h2 + 1, i, :end]
                g0 = grams[0, p, o:o + end]
                g1 = grams[1, p, o:o + end]
                g2 = grams[0, p + 1, o:o + end]
                g3 = grams[1, p + 1, o:o + end]
                for j in range(end):
                    q = ah[j] * a2[j]
                    q2 = ah[j] * a3[j]
                    plain[j] += g0[j] * q + g2[j] * q2
                    proj[j] += g1[j] * q + g3[j] * q2
                p += 2
                h2 += 2
            if h2 < heads:
                a2 = alpha[b, h2, i, :end]
                g0 = grams[0, p, o:o + end]
                g1 = grams[1, p, o:o + end]
                for j in range(end):
                    q = ah[j] * a2[j]
                    plain[j] += g0[j] * q
                    proj[j] += g1[j] * q
                p += 1
            for j in range(end):
                mean[j] += ah[j]
            for k in range(probes):
                fp = probe_f[h, k, o:o + end]
                acc = zero
                for j in range(end):
                    acc += ah[j] * fp[j]
                probe_out[b, i, k] += acc
        inv = inv_s[b, i]
        for j in range(end):
            v = np.sqrt(max(plain[j], zero))
            n_out[b, layer, i, j] = v
            nres_out[b, layer, i, j] = v
            resln_out[b, layer, i, j] = np.sqrt(max(proj[j], zero)) * inv
            mean_out[b, layer, i, j] = mean[j] / heads


TOKEN_STATS = ("s", "t_norm", "pt_norm", "N", "Res-N", "ResLN-N", "err_in", "err_out", "scale")


@njit(nogil=True, cache=True, fastmath=True)
def token_pass(rows, x, attn_out, mix_in, mix_out, u_ii, b_o, gamma, beta, probes, eps, rms, stats,
               total_r):  # pragma: no cover - compiled
    """Per real token t (row rows[t] of the flattened [B·n, d] inputs), every input read once: x (layer input),
    the real attention output (b_O included), the real norm input and output; u_ii [T, d] = Σ_h α^h_ii f^h(x_i).
    Writes stats [T, 9] in TOKEN_STATS order (s_i; ‖t_ii‖, ‖P t_ii‖; ratios N, Res-N, ResLN-N; reconstruction
    errors of the norm input and output; the output scale) and total_r [T, P] = (Σ_j Σ_h α f)·r_p for the probe
    check. With total = attention output − b_O: t_ii = u_ii + x_i, off_i = total − u_ii (= Σ_{j≠i} t_ij), P = γ ⊙ C."""
    d = x.shape[1]
    fd, eps32 = np.float32(d), np.float32(eps)
    n_probes = probes.shape[0]
    zero = np.float32(0.0)
    for t in range(rows.shape[0]):
        i = rows[t]
        sum_in = sum_y = sum_t = sum_o = zero
        err_in = top = tn2 = on2 = un2 = zero
        for p in range(n_probes):
            acc = zero
            for k in range(d):
                acc += (attn_out[i, k] - b_o[k]) * probes[p, k]
            total_r[t, p] = acc
        for k in range(d):
            total = attn_out[i, k] - b_o[k]
            y = attn_out[i, k] + x[i, k]  # what the norm input must be
            tt = u_ii[t, k] + x[i, k]
            of = total - u_ii[t, k]
            sum_in += mix_in[i, k]
            sum_y += y
            sum_t += tt
            sum_o += of
            err_in = max(err_in, abs(y - mix_in[i, k]))
            top = max(top, abs(mix_in[i, k]))
            tn2 += tt * tt
            on2 += of * of
            un2 += u_ii[t, k] * u_ii[t, k]
        m_in, m_y, m_t, m_o = (zero, zero, zero, zero) if rms else (sum_in / fd, sum_y / fd, sum_t / fd, sum_o / fd)
        var = ptn2 = pon2 = zero
        for k in range(d):
            c = mix_in[i, k] - m_in
            var += c * c
            ct = gamma[k] * (u_ii[t, k] + x[i, k] - m_t)
            ptn2 += ct * ct
            co = gamma[k] * (attn_out[i, k] - b_o[k] - u_ii[t, k] - m_o)
            pon2 += co * co
        s = np.sqrt(var / fd + eps32)
        err_out = zero
        for k in range(d):
            r = gamma[k] * (attn_out[i, k] + x[i, k] - m_y) / s + beta[k]
            err_out = max(err_out, abs(r - mix_out[i, k]))
            top = max(top, abs(r))
        tn, on, un, ptn, pon = np.sqrt(tn2), np.sqrt(on2), np.sqrt(un2), np.sqrt(ptn2), np.sqrt(pon2)
        tiny = np.float32(1e-30)
        stats[t, 0] = s
        stats[t, 1] = tn
        stats[t, 2] = ptn
        stats[t, 3] = on / max(on + un, tiny)
        stats[t, 4] = on / max(on + tn, tiny)
        stats[t, 5] = pon / max(pon + ptn, tiny)
        stats[t, 6] = err_in
        stats[t, 7] = err_out
        stats[t, 8] = top


_POOL: list = []  # [ThreadPoolExecutor] for the current torch thread count


def parallel(calls: list[tuple]) -> None:
    """Run kernel calls (fn, *args) on torch.get_num_threads() threads, inline when that is 1. Each call must write
    its own part of the outputs."""
    threads = torch.get_num_threads()
    if threads == 1 or len(calls) == 1:
        for fn, *args in calls:
            fn(*args)
        return
    if not _POOL or _POOL[0]._max_workers != threads:
        if _POOL:
            _POOL.pop().shutdown()
        _POOL.append(ThreadPoolExecutor(threads, thread_name_prefix="mixlens"))
    for fut in [_POOL[0].submit(*call) for call in calls]:
        fut.result()


def row_splits(lengths: np.ndarray, n: int, causal: bool, parts: int) -> list[tuple[int, int]]:
    """Split the flattened [B·n] target rows into `parts` ranges of about equal attention-pass work."""
    i = np.arange(n)
    cost = np.where(i[None] < lengths[:, None], (i[None] + 1) if causal else lengths[:, None], 0).ravel()
    edges = np.searchsorted(np.cumsum(cost), np.linspace(0, cost.sum(), parts + 1)[1:-1])
    bounds = [0, *sorted(set(int(e) + 1 for e in edges)), cost.size]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
