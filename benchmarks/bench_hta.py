"""Exact HTA: forward-mode (jvp + vmap, all layers and targets per input direction) vs a reverse-mode loop (one
backward pass per output coordinate e^l_{i,a}), on the bundled model for one 24-token sentence; plus the
Hutchinson estimator's error against exact for k = 16 and 64 probes.

Both sides cost the same per unit of work for every position (forward mode: per source column j, d_in JVPs;
reverse mode: per target row i, L·d backward passes), so by default each runs on a sample (`--cols` source
columns, `--rows` target rows) and its time is scaled to all n positions; the results are compared on the
sampled rows × columns. `--cols 0 --rows 0` runs both in full (minutes on an idle 2-core machine).
Run: python benchmarks/bench_hta.py [--cols 3 --rows 1]
"""

from __future__ import annotations

import argparse
import time

import torch

import mixlens
from mixlens.methods import gradients as G

SENTENCE = "the movie was a charming , often funny journey through love , loss and all the small things in real life ."


def reverse_rows(tr, rows: list[int]) -> torch.Tensor:
    """‖∂e^l_i/∂x_j‖²_F for target rows i in `rows`, by one backward pass per (l, i, a): [L, len(rows), n]."""
    n, d_in = tr.layers[0].x.shape[1], G.input_dim(tr, "word")
    delta = torch.zeros(1, n, d_in, requires_grad=True)
    with torch.enable_grad():
        e, _ = G.states_fn(tr, "word")(delta)  # [L, 1, n, d]
        out = torch.zeros(e.shape[0], len(rows), n)
        for layer in range(e.shape[0]):
            for r, i in enumerate(rows):
                for a in range(e.shape[-1]):
                    (g,) = torch.autograd.grad(e[layer, 0, i, a], delta, retain_graph=True)
                    out[layer, r] += g[0].pow(2).sum(-1)
    return out


def spread(k: int, n: int) -> list[int]:
    return list(range(n)) if k <= 0 or k >= n else [int(v) for v in torch.linspace(1, n - 2, k).round()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cols", type=int, default=3, help="source columns run in forward mode (0 = all)")
    ap.add_argument("--rows", type=int, default=1, help="target rows run in the reverse loop (0 = all)")
    args = ap.parse_args()
    lens = mixlens.load()
    tr = lens.trace([SENTENCE])
    n = tr.layers[0].x.shape[1]
    cols, rows = spread(args.cols, n), spread(args.rows, n)
    print(f"sentence: {n} tokens; torch threads: {torch.get_num_threads()}; source columns {cols}; target rows {rows}")
    t0 = time.perf_counter()
    exact = G.jacobian_norms(tr, mode="exact", sources=cols if len(cols) < n else None).hidden[0]  # [L, n, n]
    t_fwd = (time.perf_counter() - t0) * n / len(cols)
    print(f"forward-mode exact HTA, all layers and targets: {t_fwd:.1f} s" +
          ("" if len(cols) == n else f" (measured on {len(cols)} source columns, scaled to {n})"), flush=True)
    t0 = time.perf_counter()
    rev = reverse_rows(tr, rows)  # [L, rows, n]
    t_rev = (time.perf_counter() - t0) * n / len(rows)
    passes = len(rows) * rev.shape[0] * tr.layers[0].x.shape[-1]
    print(f"reverse-mode loop, {passes} backward passes timed: {t_rev:.1f} s" +
          ("" if len(rows) == n else f" (measured on {len(rows)} target rows, scaled to {n})"))
    print(f"speed-up: {t_rev / t_fwd:.1f}x")
    a, b = exact[:, rows][..., cols], rev[..., cols]
    err = (a - b).abs().max().item()
    rel = ((a - b).abs() / b.abs().clamp_min(1e-12)).max().item()
    print(f"compared block (all layers x {len(rows)} rows x {len(cols)} cols): max |diff| of ‖J‖²_F {err:.2e}, "
          f"max relative {rel:.2e} -> {'OK' if rel <= 1e-5 else 'MISMATCH'} at 1e-5")
    if len(cols) == n and len(rows) == n:
        c_f, c_r = G.shares(exact)[0], G.shares(rev)[0]
        print(f"HTA shares max |diff|: {(c_f - c_r).abs().max():.2e}")
    for k in (16, 64):
        t0 = time.perf_counter()
        est = G.jacobian_norms(tr, mode="estimate", probes=k, seed=0, sources=cols if len(cols) < n else None)
        t_est = (time.perf_counter() - t0) * n / len(cols)
        sq, se = est.hidden[0][..., cols], est.hidden_se[0][..., cols]
        ex = exact[..., cols]
        m = ex > 0
        rel_err = ((sq - ex).abs() / ex)[m]
        rel_se = (se / ex)[m]
        cover = ((sq - ex).abs() <= 2 * se)[m].float().mean().item()
        print(f"estimate k={k}: {t_est:.1f} s (scaled); ‖J‖²_F relative error median {rel_err.median():.3f}, "
              f"90th pct {rel_err.quantile(0.9):.3f}; reported relative SE median {rel_se.median():.3f}; "
              f"|error| <= 2 SE for {100 * cover:.0f}% of blocks")


if __name__ == "__main__":
    main()
