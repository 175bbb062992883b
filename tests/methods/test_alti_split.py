"""ALTI's sign split (`alti._sign_split`, the CPU path) against the L1 formula in float64, on inputs built to reach
every branch: pairs exact from the linear part alone, pairs with a few risky coordinates, pairs built whole (many
risky coordinates), zeros in y, causal and full rows. The self pairs (T with the residual) come in precomputed, as
`alti.self_contributions` gives them; the layer tests in test_global_methods.py check those against the vectors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mixlens.methods import alti as alti_mod


def l1_reference(alpha, pft, px, y, rows, ends) -> np.ndarray:
    """max(0, ‖y_k‖₁ − ‖y_k − T_k(x_j)‖₁) in float64, T built whole; 0 for sources j ≥ ends[k]."""
    a, p, x, yy = (t.double().numpy() for t in (alpha, pft, px, y))
    h, k, n = a.shape
    out = np.zeros((k, n))
    for r in range(k):
        t = np.einsum("hj,jdh->jd", a[:, r], p)  # [n, d]
        t[rows[r]] += x[r]
        c = np.abs(yy[r]).sum() - np.abs(yy[r][None] - t).sum(1)
        out[r, : ends[r]] = np.maximum(c, 0)[: ends[r]]
    return out


def split_inputs(causal: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    heads, n, d_h, d, k = 3, 40, 4, 12, 10
    v = torch.randn(heads, n, d_h, generator=g)
    w = torch.randn(heads, d_h, d, generator=g)
    pft = torch.einsum("hjc,hcd->jdh", v, w).contiguous()  # [n, d, H]
    rows = torch.arange(n - k, n) if causal else torch.arange(0, n, n // k)[:k]
    ends = rows + 1 if causal else torch.full_like(rows, n)
    scores = torch.randn(heads, k, n, generator=g) * 3  # peaked rows: some α near 1, most small
    if causal:
        scores = scores.masked_fill(torch.arange(n)[None, None] >= ends[None, :, None], float("-inf"))
    alpha = scores.softmax(-1)
    px = torch.randn(k, d, generator=g)
    y = torch.randn(k, d, generator=g)
    y[0, :3] = 0.0  # exact zeros: always risky
    y[1] *= 1e-3  # a small output: every pair has many risky coordinates
    t = torch.einsum("hj,jdh->jd", alpha[:, 2], pft)
    y[2] = t[5] + 1e-2 * torch.randn(d, generator=g)  # y ≈ T_2(x_5): sign flips at that pair
    big = (pft.abs().amax(1) * (1 + alti_mod.BOUND_MARGIN)).T.contiguous()  # [H, n]
    return alpha, pft, big, v, w, px, y, rows, ends


def self_pairs(alpha, pft, px, y, rows) -> torch.Tensor:
    """The self pairs' c [K] (T with the residual px), which `_sign_split` is given (`alti.self_contributions`)."""
    t = torch.stack([torch.einsum("h,dh->d", alpha[:, r, i], pft[i]) for r, i in enumerate(rows.tolist())]) + px
    return (y.abs().sum(-1) - (y - t).abs().sum(-1)).clamp_min(0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [None, 1])
def test_sign_split_equals_the_l1_formula(causal, chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(alti_mod, "SPLIT_CHUNK_ELEMENTS", chunk)  # one target row per matmul chunk
    alpha, pft, big, v, w, px, y, rows, ends = split_inputs(causal)
    diag = self_pairs(alpha, pft, px, y, rows)
    got = alti_mod._sign_split(alpha, pft, big, v, w, diag, y, rows, ends).double().numpy()
    want = l1_reference(alpha, pft, px, y, rows.numpy(), ends.numpy())
    scale = float(y.abs().sum(-1).max())
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)

    # every branch was reached: pairs with no risky coordinate, a few, and many (built whole)
    bound = torch.einsum("hkj,hj->kj", alpha, big)
    ay = y.abs().sort(-1).values
    risky = torch.searchsorted(ay, bound.contiguous(), right=True)
    real = torch.arange(alpha.shape[2])[None] < ends[:, None]
    wide = y.shape[1] // alti_mod.WIDE
    assert (
        ((risky == 0) & real).any() and ((risky > 0) & (risky <= wide) & real).any() and ((risky > wide) & real).any()
    )
    assert (got[2] > 0).any() and (got == 0).any()


def test_sign_split_without_the_correction_would_be_wrong():
    """The risky coordinates matter on these inputs: the linear part alone misses the reference (so the test above
    checks the correction, not only the dot products)."""
    alpha, pft, big, v, w, px, y, rows, ends = split_inputs(True)
    diag = self_pairs(alpha, pft, px, y, rows)
    wrong = alti_mod._sign_split(alpha, pft, torch.zeros_like(big), v, w, diag, y, rows, ends).double().numpy()
    want = l1_reference(alpha, pft, px, y, rows.numpy(), ends.numpy())
    assert np.abs(wrong - want).max() > 1e-2 * float(y.abs().sum(-1).max())


def test_ascending_orders_ties_by_position():
    y = np.array([[0.5, -0.25, 0.0, -0.5, 0.25, -0.0]], np.float32)
    np.testing.assert_array_equal(alti_mod._ascending(y), np.argsort(np.abs(y), axis=1, kind="stable"))
