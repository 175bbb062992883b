"""Compiled inner loops of the norm decomposition (numba): one pass over the tokens and one over the attention maps
of a layer. Both release the GIL and write disjoint parts of their outputs; `parallel` spreads calls over threads.

For every real target i and source j the attention pass evaluates the two Gram quadratic forms
‖Σ_h α^h_ij F_k^h(x_j)‖² = Σ_{h,h'} α^h_ij α^h'_ij G_k[h, h', j] (k = plain f, LayerNorm-projected f), the head
mean of α and the probe sums Σ_h Σ_j α^h_ij (f^h(x_j)·r_p) of the exactness check. α is read in its natural
[head, target, source] layout, source innermost, so nothing is transposed or materialised per (i, j).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit


@njit(nogil=True, cache=True, fastmath=True)
def token_pass(cf, start, t0, t1, vh, a_ii, rows, x, attn_out, mix_in, mix_out, mean_w, gamma2, w_probe, b_o, gamma,
               beta, probes, eps, rms, layer, grams, probe_f, diag, total_r, check, f_norm_out, ratio_out,
               scale_out):  # pragma: no cover - compiled
    """Everything per token of one layer, for tokens start + t0 .. start + t1 - 1 of one block.

    Inputs: cf [H, c, d] = C f^h = v^h W_O^h C of the block's tokens start .. start + c - 1; vh [H, T, d_h];
    a_ii [H, T]; rows [T] (row of token t in the flattened [B·n] layout); x (layer input), attn_out (real attention
    output, b_O included), mix_in, mix_out (real norm input and output) [B·n, d]; mean_w [H, d_h] row means of
    W_O^h (empty for RMSNorm: f is then not centred); gamma2 [d] = γ²; w_probe [H, P, d_h] = (W_O^h r_p)ᵀ;
    b_o, gamma, beta [d]; probes [P, d].

    Writes per token t: grams [2, H(H+1)/2, T], the Gram matrices of f and of P f = γ ⊙ C f (upper triangles
    h ≤ h' row-major, off-diagonal entries doubled); probe_f [H, P, T] = f^h·r_p; diag [2, T] = ‖t_ii‖,
    ‖P t_ii‖/s_i; total_r [T, P] = total·r_p; check [2, T] = reconstruction error of the norm input and output,
    output scale; and at (b, layer, ·, i): f_norm_out [B, L, H, n] = ‖f^h‖, ratio_out [5, B, L, n] = W, N, Res-W,
    Res-N, ResLN-N, scale_out [B, L, n] = s_i.

    With μ^h = v^h·mean(W_O^h): f^h·f^h' = C f^h·C f^h' + d μ^h μ^h'. With total = attention output − b_O and
    u_ii = Σ_h α^h_ii f^h: t_ii = u_ii + x_i and off_i = total − u_ii = Σ_{j≠i} t_ij."""
    heads, d = cf.shape[0], cf.shape[2]
    n = f_norm_out.shape[3]
    n_probes = probes.shape[0]
    zero = np.float32(0.0)
    tiny = np.float32(1e-30)
    fd, eps32 = np.float32(d), np.float32(eps)
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
                for a in range(vh.shape[2]):
                    acc += vh[h, tt, a] * mean_w[h, a]
                mu[h] = acc
                shift += a_ii[h, tt] * acc
        for k in range(d):
            u[k] = shift
        p = 0
        w_mix = zero
        for h in range(heads):
            fh = cf[h, t]
            ah = a_ii[h, tt]
            w_mix += ah
            for k in range(d):
                w[k] = fh[k] * gamma2[k]
                u[k] += ah * fh[k]
            for h2 in range(h, heads):
                f2 = cf[h2, t]
                s0 = zero
                s1 = zero
                for k in range(d):
                    s0 += fh[k] * f2[k]
                    s1 += w[k] * f2[k]
                s0 += fd * mu[h] * mu[h2]
                if h2 == h:
                    f_norm_out[b, layer, h, i] = np.sqrt(max(s0, zero))
                    grams[0, p, tt] = s0
                    grams[1, p, tt] = s1
                else:
                    grams[0, p, tt] = 2 * s0
                    grams[1, p, tt] = 2 * s1
                p += 1
            for q in range(n_probes):
                acc = zero
                for a in range(vh.shape[2]):
                    acc += vh[h, tt, a] * w_probe[h, q, a]
                probe_f[h, q, tt] = acc
        for q in range(n_probes):
            acc = zero
            for k in range(d):
                acc += (attn_out[row, k] - b_o[k]) * probes[q, k]
            total_r[tt, q] = acc
        sum_in = sum_y = sum_t = sum_o = zero
        err_in = top = tn2 = on2 = un2 = zero
        for k in range(d):
            y = attn_out[row, k] + x[row, k]  # what the norm input must be
            tk = u[k] + x[row, k]
            of = attn_out[row, k] - b_o[k] - u[k]
            sum_in += mix_in[row, k]
            sum_y += y
            sum_t += tk
            sum_o += of
            err_in = max(err_in, abs(y - mix_in[row, k]))
            top = max(top, abs(mix_in[row, k]))
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
        s = np.sqrt(var / fd + eps32)
        err_out = zero
        for k in range(d):
            r = gamma[k] * (attn_out[row, k] + x[row, k] - m_y) / s + beta[k]
            err_out = max(err_out, abs(r - mix_out[row, k]))
            top = max(top, abs(r))
        tn, on, un, ptn, pon = np.sqrt(tn2), np.sqrt(on2), np.sqrt(un2), np.sqrt(ptn2), np.sqrt(pon2)
        w_mix = 1 - w_mix / heads
        diag[0, tt] = tn
        diag[1, tt] = ptn / s
        check[0, tt] = max(err_in, err_out)
        check[1, tt] = top
        scale_out[b, layer, i] = s
        ratio_out[0, b, layer, i] = w_mix
        ratio_out[1, b, layer, i] = on / max(on + un, tiny)
        ratio_out[2, b, layer, i] = w_mix / 2
        ratio_out[3, b, layer, i] = on / max(on + tn, tiny)
        ratio_out[4, b, layer, i] = pon / max(pon + ptn, tiny)


@njit(nogil=True, cache=True, fastmath=True)
def attention_pass(alpha, grams, probe_f, offsets, lengths, scale, diag, total_r, causal, layer, r0, r1, n_out,
                   nres_out, resln_out, mean_out, probe_err):  # pragma: no cover - compiled
    """Rows r0 .. r1 - 1 of the flattened [B·n] targets of one layer. alpha [B, H, n, n]; grams [2, H(H+1)/2, T],
    probe_f [H, P, T], diag [2, T], total_r [T, P] as written by `token_pass`, per real token t = offsets[b] + j;
    offsets, lengths [B]; scale [B, L, n] (s_i). Writes the maps [B, L, n, n] at `layer` (norms square-rooted,
    N-ResLN divided by s_i, the N-Res and N-ResLN diagonals from diag) and probe_err [T] = max_p |Σ_h Σ_j α^h_ij
    f^h(x_j)·r_p − total_i·r_p|. Padded cells are not written. Two Gram rows per inner loop halve the accumulator
    traffic."""
    heads, n = alpha.shape[1], alpha.shape[2]
    n_probes = probe_f.shape[1]
    zero = np.float32(0.0)
    plain_buf = np.empty(n, np.float32)
    proj_buf = np.empty(n, np.float32)
    mean_buf = np.empty(n, np.float32)
    probed = np.empty(n_probes, np.float32)
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
        probed[:] = zero
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
            for k in range(n_probes):
                fp = probe_f[h, k, o:o + end]
                acc = zero
                for j in range(end):
                    acc += ah[j] * fp[j]
                probed[k] += acc
        inv = 1 / scale[b, layer, i]
        for j in range(end):
            v = np.sqrt(max(plain[j], zero))
            n_out[b, layer, i, j] = v
            nres_out[b, layer, i, j] = v
            resln_out[b, layer, i, j] = np.sqrt(max(proj[j], zero)) * inv
            mean_out[b, layer, i, j] = mean[j] / heads
        t = o + i
        nres_out[b, layer, i, i] = diag[0, t]
        resln_out[b, layer, i, i] = diag[1, t]
        err = zero
        for k in range(n_probes):
            err = max(err, abs(probed[k] - total_r[t, k]))
        probe_err[t] = err


_POOLS: dict[int, ThreadPoolExecutor] = {}  # helper threads by count
os.register_at_fork(after_in_child=_POOLS.clear)  # a forked child has none of the parent's threads
PAIRS_PER_CALL = 32768  # (target, source) pairs per attention-pass call when a layer is split over threads
TOKENS_PER_CALL = 32  # tokens per token-pass call when a block is split over threads


def parallel(calls: list[tuple]) -> None:
    """Run kernel calls (fn, *args) on torch.get_num_threads() threads, the calling one included, each thread taking
    the next call when it is free (a core still held by torch's spinning OpenMP workers then simply takes fewer).
    Each call must write its own part of the outputs."""
    threads = min(torch.get_num_threads(), len(calls))
    if threads <= 1:
        for fn, *args in calls:
            fn(*args)
        return
    if threads - 1 not in _POOLS:
        _POOLS[threads - 1] = ThreadPoolExecutor(threads - 1, thread_name_prefix="mixlens")
    todo = iter(calls)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                call = next(todo, None)
            if call is None:
                return
            call[0](*call[1:])

    helpers = [_POOLS[threads - 1].submit(work) for _ in range(threads - 1)]
    try:
        work()
    finally:
        for fut in helpers:
            fut.result()


def token_splits(count: int) -> list[tuple[int, int]]:
    """[0, count) in ranges of TOKENS_PER_CALL (one range when torch runs on one thread)."""
    step = count if torch.get_num_threads() == 1 else TOKENS_PER_CALL
    return [(a, min(a + step, count)) for a in range(0, count, step)]


def row_splits(lengths: np.ndarray, n: int, causal: bool) -> list[tuple[int, int]]:
    """Split the flattened [B·n] target rows into ranges of about PAIRS_PER_CALL (target, source) pairs each (one range
    when torch runs on one thread)."""
    i = np.arange(n)
    cost = np.where(i[None] < lengths[:, None], (i[None] + 1) if causal else lengths[:, None], 0).ravel()
    total = int(cost.sum())
    parts = 1 if torch.get_num_threads() == 1 else max(1, total // PAIRS_PER_CALL)
    edges = np.searchsorted(np.cumsum(cost), np.linspace(0, total, parts + 1)[1:-1])
    bounds = [0, *sorted(set(int(e) + 1 for e in edges)), cost.size]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
