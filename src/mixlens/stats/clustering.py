"""Head clustering (Clark et al. 2019, §6): Jensen–Shannon distances between heads and a 2-D MDS embedding.

Two heads are compared on the same inputs, row by row: for query token i, JS(A^a_i·, A^b_i·) of the rows
smoothed as (1−ε)A + ε/n over real keys; the divergence (nats) is pooled over all real query rows of all
inputs, and the distance is its square root (a metric). The embedding is classical (Torgerson) MDS.
"""

from __future__ import annotations

import numpy as np
import torch

BEHAVIOURS = ("cls", "sep", "punct", "self", "prev", "next")


def _smoothed(maps: torch.Tensor, mask: torch.Tensor, smooth: float) -> torch.Tensor:
    """maps [B, K, n, n] → (1−ε)A + ε/n over real keys (0 on pad keys)."""
    m = mask.float()
    n = m.sum(-1).view(-1, 1, 1, 1)
    return ((1 - smooth) * maps.float() + smooth / n) * m[:, None, None, :]


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


def js_divergence_sums(maps: torch.Tensor, mask: torch.Tensor, smooth: float = 1e-4) -> torch.Tensor:
    """Sum over real query rows of JS(A^a_i·, A^b_i·) for every pair of maps (heads).

    maps [B, K, n, n] (rows sum to 1), mask [B, n] bool → [B, K, K] (symmetric, zero diagonal).
    JS(P, Q) = H((P+Q)/2) − (H(P) + H(Q))/2.
    """
    n = int(mask.sum(-1).max())  # drop all-pad key/query columns of the batch
    p = _smoothed(maps[..., :n, :n], mask[:, :n], smooth)
    rows = mask[:, :n].float()[:, None, :]  # [B, 1, n]
    h = _entropy(p)  # [B, K, n]
    k = p.shape[1]
    out = torch.zeros(p.shape[0], k, k)
    for a in range(k - 1):  # upper triangle only; JS is symmetric
        hm = _entropy(0.5 * (p[:, a : a + 1] + p[:, a + 1 :]))  # [B, K−a−1, n]
        out[:, a, a + 1 :] = ((hm - 0.5 * (h[:, a : a + 1] + h[:, a + 1 :])) * rows).sum(-1)
    out = out + out.transpose(1, 2)
    return out.clamp_min_(0)


def js_distance(divergence: np.ndarray) -> np.ndarray:
    """√JS: the Jensen–Shannon distance from mean divergences [K, K]."""
    return np.sqrt(np.clip(divergence, 0, None))


def classical_mds(dist: np.ndarray, dims: int = 2) -> np.ndarray:
    """Torgerson MDS: coordinates [K, dims] whose Euclidean distances best match `dist` [K, K].

    B = −½ J D² J with J = I − 11ᵀ/K; coordinates = top eigenvectors × √eigenvalue. Deterministic
    (the sign of each axis is fixed so that its largest-magnitude coordinate is positive).
    """
    k = dist.shape[0]
    j = np.eye(k) - 1.0 / k
    b = -0.5 * j @ (dist**2) @ j
    vals, vecs = np.linalg.eigh(b)
    top = np.argsort(vals)[::-1][:dims]
    coords = vecs[:, top] * np.sqrt(np.clip(vals[top], 0, None))
    signs = np.sign(coords[np.abs(coords).argmax(0), np.arange(dims)])
    return coords * np.where(signs == 0, 1, signs)


def dominant_behaviour(masses: dict[str, np.ndarray], threshold: float = 0.5) -> np.ndarray:
    """Label each head by the token type that gets most of its mass ('cls', 'sep', 'punct', 'self',
    'prev', 'next'), or 'broad' when none gets at least `threshold`. masses {type: [K]} → [K] str."""
    stack = np.stack([masses[b] for b in BEHAVIOURS])  # [6, K]
    best = stack.argmax(0)
    labels = np.array(BEHAVIOURS, dtype=object)[best]
    labels[stack.max(0) < threshold] = "broad"
    return labels
