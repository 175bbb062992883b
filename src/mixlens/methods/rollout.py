"""Attention rollout and attention flow (Abnar & Zuidema 2020; docs/DESIGN.md §3.5), and the shared rollout product.

Per layer l, Â_l = 0.5 ᾱ_l + 0.5 I with rows renormalised (ᾱ = head-mean attention). Rollout: R_l = Â_l R_{l−1};
layer l of the result explains the output of layer l in terms of the input tokens. Flow: the maximum flow from
input token j to token i of layer l in the layered graph whose edges (l−1, j) → (l, i) have capacity Â_l[i, j].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from mixlens.errors import MixlensError
from mixlens.memory import release
from mixlens.methods.attention import alpha_rows, rows_of, stacked_alpha
from mixlens.methods.memo import StreamLayer, gathered, memo_of
from mixlens.methods.registry import ROLLOUT_MEMORY, TRACED, Card, Planned, Stream, register
from mixlens.trace import Trace

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("global.md", "whole-layer and global attribution")

FLOW_MAX_TOKENS = 32  # n² max-flows per layer on graphs of up to L·n² edges
FLOW_SCALE = 1 << 24  # integer capacity of an edge of weight 1
ROW_CHUNK = 256  # rows of a layer's matrix built at once by `rollout_rows`

LayerRows = Callable[[int], Callable[[torch.Tensor], torch.Tensor]]  # layer → (rows [B, K] → matrix rows [B, K, n])


def pair_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, n] real-token mask → [B, 1, n, n] mask of (real target, real source) pairs."""
    return (mask[:, :, None] & mask[:, None, :])[:, None]


def row_normalize(m: torch.Tensor) -> torch.Tensor:
    """Rows (last axis) scaled to sum to 1; all-zero rows (padding) stay 0."""
    s = m.sum(-1, keepdim=True)
    return m / torch.where(s > 0, s, torch.ones_like(s))


RESCALE_ABOVE = 2.0**64  # unnormalised products of deep models leave float32's range (≈ 2^±126)
RESCALE_BELOW = 2.0**-64  # ... upwards (1e+18 after 30 layers) and downwards (8e-41, a denormal: precision lost)


def in_range(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """x divided, per slice over `dims`, by the power of two just above its largest magnitude where that is above
    `RESCALE_ABOVE` or below `RESCALE_BELOW` (but not 0; other slices unchanged): a positive factor per slice, so
    rankings and ratios within it stay, and a product of many layers neither overflows nor underflows."""
    top = x.abs().amax(dim=dims, keepdim=True)
    out = (top > RESCALE_ABOVE) | ((top < RESCALE_BELOW) & (top > 0))
    if not bool(out.any()):
        return x
    return x / torch.where(out, torch.exp2(torch.ceil(torch.log2(top))), torch.ones_like(top))


DISPLAY_NOTE = "rows scaled to sum to 1 for display (the JSON holds the plain products; docs/reference/global.md)"


def display_rows(method: str, rows: np.ndarray) -> tuple[np.ndarray, bool]:
    """Rows (last axis) of `method` as a table shows them: the plain products of unnormalised maps (methods that
    declare `unnormalised`; their scale grows or shrinks with depth, 1e+18 or 8e-41 after 30 layers) scaled to sum
    to 1, which keeps each
    row's ranking and ratios; → (rows, whether they were scaled). Other methods unchanged."""
    from mixlens.methods.registry import REGISTRY

    spec = REGISTRY.get(method)
    if spec is None or not spec.unnormalised:
        return rows, False
    rows = np.asarray(rows, dtype=np.float64)
    total = rows.sum(-1, keepdims=True)
    ok = np.isfinite(total) & (total > 0)
    return np.where(ok, rows / np.where(ok, total, 1.0), rows), True


def rollout(mats: torch.Tensor, *, normalize: bool = False) -> torch.Tensor:
    """Cumulative product R_l = M_l R_{l−1} (R_0 = M_0) of per-layer matrices mats [B, L, n, n] → [B, L, n, n].

    With `normalize`, the rows of every M_l are scaled to sum to 1 first (then every row of R_l does too). Without,
    the product can grow or shrink by a factor per layer (norm maps of deep pre-LN decoders): once the largest value
    of R_l of an input leaves [`RESCALE_BELOW`, `RESCALE_ABOVE`] it is divided by a power of two (`in_range`), so
    R_l is exact (the plain product) while it stays in that range, and otherwise exact up to one positive factor per
    input and layer instead of overflowing to inf or underflowing to denormals and 0."""
    mats = row_normalize(mats) if normalize else mats
    out = torch.empty_like(mats)
    acc = mats[:, 0]
    out[:, 0] = acc
    for layer in range(1, mats.shape[1]):
        acc = in_range(mats[:, layer] @ acc, (1, 2))
        out[:, layer] = acc
    return out


def row_pair_mask(mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[B, n] real-token mask and target positions rows [B, K] → [B, K, n] mask of (real target, real source)."""
    return mask.gather(1, rows)[:, :, None] & mask[:, None, :]


@torch.no_grad()
def rollout_rows(
    trace: Trace, layer_rows: LayerRows, targets: torch.Tensor, *, normalize: bool = False
) -> torch.Tensor:
    """Rows `targets` [B, K] of every layer's rollout R_l = M_l ⋯ M_0, never forming an n × n product: row t of R_l
    is e_t M_l M_{l−1} ⋯ M_0, so going down the layers (m = L−1 … 0) each state r (one per output layer l ≥ m and
    target) becomes r · M_m = Σ_i r_i M_m[i, :], with the rows of M_m built `ROW_CHUNK` at a time by
    `layer_rows(m)(rows)` (and skipped where every r_i is 0). Memory: the states, [B, L, K, n]; compute
    Σ_m (L − m)·K·n² per input. `normalize`: rows of every M_m scaled to sum to 1 first; without, a row outside
    [`RESCALE_BELOW`, `RESCALE_ABOVE`] is divided by a power of two (`in_range`). → [B, L, K, n]."""
    b, n = trace.mask.shape
    n_layers, k = len(trace.layers), targets.shape[1]
    dev = targets.device
    out = torch.zeros(b, n_layers, k, n, device=dev)
    start = torch.zeros(b, k, n, device=dev).scatter_(2, targets[:, :, None], 1.0)  # e_t
    positions = torch.arange(n, device=dev)
    tick = memo_of(trace).progress
    for m in reversed(range(n_layers)):
        out[:, m] = start
        state = out[:, m:].reshape(b, (n_layers - m) * k, n)
        new = torch.zeros_like(state)
        rows_of = layer_rows(m)
        for c0 in range(0, n, ROW_CHUNK):
            part = state[..., c0 : c0 + ROW_CHUNK]
            if not part.any():
                continue
            mat = rows_of(positions[c0 : c0 + ROW_CHUNK].expand(b, -1))  # [B, c, n]
            new.baddbmm_(part, row_normalize(mat) if normalize else mat)
        out[:, m:] = in_range(new, (2,)).view(b, n_layers - m, k, n)  # one positive factor per row at most
        release(n)
        if tick is not None:
            tick("propagating the target rows", n_layers - m, n_layers)
    return out


@torch.no_grad()
def residual_attention(trace: Trace) -> torch.Tensor:
    """Â_l = 0.5 ᾱ_l + 0.5 I on real tokens, rows renormalised: [B, L, n, n], padding 0."""
    pm = pair_mask(trace.mask)
    a = stacked_alpha(trace).mean(2) * pm
    eye = torch.eye(a.shape[-1], dtype=a.dtype) * pm
    return row_normalize(0.5 * a + 0.5 * eye)


def residual_rows(alpha: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Rows at positions rows [B, K] (None: every row) of one layer's Â (as `residual_attention`) from its α
    [B, H, n, n] and the real-token mask [B, n]: [B, K, n]."""
    every = rows is None
    if rows is None:
        rows = torch.arange(mask.shape[1], device=mask.device).repeat(len(mask), 1)
    return residual_of_rows(alpha.float() if every else alpha_rows(alpha.float(), rows), mask, rows)


def residual_of_rows(alpha: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`residual_rows` from α's rows at positions rows [B, K] ([B, H, K, n]): [B, K, n]."""
    pm = row_pair_mask(mask, rows)
    a = alpha.mean(1) * pm
    eye = (rows[:, :, None] == torch.arange(pm.shape[-1], device=rows.device)) * pm
    return row_normalize(0.5 * a + 0.5 * eye)


def kept_matrices(trace: Trace, name: str) -> LayerRows | None:
    """Streamed trace: the per-layer matrices `name` [B, n, n] its layer sink kept, as `LayerRows` for
    `rollout_rows`; None when it kept none."""
    fns = memo_of(trace).layer_fns.get(name)
    if fns is None:
        return None
    return lambda m: fns[m]()


ROLLOUT = "attention_rollout"  # the key of what the layer sink keeps


def stream_layer(s: StreamLayer, whole: bool) -> None:
    """The layer sink of a streamed trace (`registry.Stream`): the factory of any rows of this layer's Â, from the
    whole matrix, or in row mode from what rebuilds α's rows (q, K and the softmax normaliser)."""
    mask = s.mask
    if s.row_mode:
        small = s.lt.for_rows()
        s.keep_fn(ROLLOUT, lambda: lambda r: residual_of_rows(small.alpha_rows(r), mask, r))
    else:
        s.keep_fn(ROLLOUT, gathered(residual_rows(s.lt.alpha, mask, None)))


@register(
    "attention_rollout",
    row_mode=True,
    explains=True,
    stream=Stream(ROLLOUT, stream_layer, whole=True),
    card=Card(
        definition="R_l = Â_l R_{l−1}, Â = rows-normalised 0.5·mean_h α^h + 0.5·I (Abnar & Zuidema 2020); layer l in "
        "terms of the input tokens.",
        passes=TRACED + ".",
        memory=ROLLOUT_MEMORY + ".",
        background=BACKGROUND,
    ),
)
def attention_rollout(trace: Trace) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020): product of 0.5·mean attention + 0.5·I over layers 1..l."""
    targets = rows_of(trace)
    if targets is not None:
        layer_rows = kept_matrices(trace, ROLLOUT) or (
            lambda m: lambda rows: residual_rows(trace.layers[m].alpha, trace.mask, rows)
        )
        return rollout_rows(trace, layer_rows, targets)
    return rollout(residual_attention(trace))


def _flow_one(a_hat: torch.Tensor) -> torch.Tensor:
    """Max-flow matrix for one input: a_hat [L, n, n] → [L, n(target), n(source)], rows normalised.

    Node (l, j) is index l·n + j; scipy's max-flow needs integer capacities, so they are scaled by 2^24
    (flow values are exact to ~n·2^-24)."""
    n_layers, n, _ = a_hat.shape
    cap = np.rint(a_hat.double().numpy() * FLOW_SCALE).astype(np.int32)  # [L, i, j]
    out = np.zeros((n_layers, n, n))
    rows, cols, vals = [], [], []
    j_idx, i_idx = np.meshgrid(np.arange(n), np.arange(n))
    for layer in range(n_layers):
        rows.append((layer * n + j_idx).ravel())
        cols.append(((layer + 1) * n + i_idx).ravel())
        vals.append(cap[layer].ravel())
        size = (layer + 2) * n
        graph = csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(size, size))
        for i in range(n):
            for j in range(n):
                out[layer, i, j] = maximum_flow(graph, j, (layer + 1) * n + i, method="dinic").flow_value
    return row_normalize(torch.from_numpy(out / FLOW_SCALE).to(a_hat.dtype))


def flow_limit(plan: Planned) -> None:
    """Attention flow runs n² max-flows per layer: refuse inputs over `FLOW_MAX_TOKENS` before the weights load."""
    for k, n in enumerate(plan.token_counts()):
        if n > FLOW_MAX_TOKENS:
            raise MixlensError(
                f"attention_flow is limited to {FLOW_MAX_TOKENS} tokens (it runs n² max-flows per layer); "
                f"input {k + 1} has {n}: shorten it or use attention_rollout"
            )


@register(
    "attention_flow",
    slow=True,
    precheck=flow_limit,
    card=Card(
        definition="Entry (i, j) of layer l = max-flow from input token j to node (l, i) over the layered graph with "
        "capacities Â_l[i, j], rows normalised (Abnar & Zuidema 2020).",
        passes=TRACED + ", then n² max-flows per layer (scipy); limited to 32 tokens.",
        memory="[L, n, n]; no row mode.",
        background=BACKGROUND,
    ),
)
def attention_flow(trace: Trace) -> torch.Tensor:
    """Attention flow (Abnar & Zuidema 2020): max-flow over 0.5·A+0.5·I layers, rows normalised; inputs ≤ 32 tokens."""
    lengths = trace.lengths
    if max(lengths) > FLOW_MAX_TOKENS:
        raise MixlensError(
            f"attention_flow is limited to {FLOW_MAX_TOKENS} tokens (it runs n² max-flows per "
            f"layer); an input has {max(lengths)}: shorten it or use attention_rollout"
        )
    a_hat = residual_attention(trace)
    out = torch.zeros_like(a_hat)
    for b, n in enumerate(lengths):
        out[b, :, :n, :n] = _flow_one(a_hat[b, :, :n, :n])
    return out
