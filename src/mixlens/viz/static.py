"""Static figures (matplotlib, Agg) of the report views: token×token heatmap, bipartite links, mixing-ratio curves.

Paper defaults: 9 pt fonts, readable token labels (thinned beyond 60 tokens), a labelled colour bar, tight
bounding box, 300 dpi for raster output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import rc_context
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure  # used without pyplot: renders with Agg, no display needed

from mixlens.errors import MixlensError
from mixlens.result import Analysis, Attribution, atomic_write
from mixlens.viz.labels import model_label, token_text

FORMATS = ("png", "svg", "pdf")
STYLE: dict[Any, Any] = {
    "font.size": 9,
    "axes.titlesize": 9,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 8,
    "svg.fonttype": "none",
    "pdf.fonttype": 42,
}
RATIO_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")


def select_map(attr: Attribution, b: int, layer: int | None = None, head: int | None = None) -> tuple[np.ndarray, str]:
    """The [target, source] matrix of input b at `layer` (negative counts from the end) and `head` (None: the
    method's own map, or the mean over heads for per-head values); other leading axes take index 0.
    Returns (matrix [n, n], a short description)."""
    if attr.dims[-2:] != ("target", "source"):
        raise MixlensError(f"'{attr.method}' has axes ({', '.join(attr.dims)}), not a token × token map")
    v = attr.input(b)  # [*lead, n, n]
    parts: list[str] = []
    for d in attr.dims[:-2]:
        size = v.shape[0]
        if d == "layer":
            if layer is None:
                layer = size - 1
            if not -size <= layer < size:
                raise MixlensError(f"layer {layer} out of range; '{attr.method}' has {size} layers (0..{size - 1})")
            v, parts = v[layer], [*parts, f"layer {layer % size}"]
        elif d == "head":
            if head is None:
                v, parts = v.mean(0), [*parts, "mean over heads"]
            elif not 0 <= head < size:
                raise MixlensError(f"head {head} out of range; the model has {size} heads (0..{size - 1})")
            else:
                v, parts = v[head], [*parts, f"head {head}"]
        else:
            v, parts = v[0], [*parts, f"{d} 0"]
    if head is not None and "head" not in attr.dims:
        raise MixlensError(f"'{attr.method}' has no per-head values")
    return v, ", ".join(parts)


def _tick_labels(ax, tokens: list[str], axis: str) -> None:
    n = len(tokens)
    step = max(1, int(np.ceil(n / 60)))
    pos = np.arange(0, n, step)
    labels = [token_text(tokens[k]) for k in pos]
    if axis == "x":
        ax.set_xticks(pos, labels, rotation=90)
    else:
        ax.set_yticks(pos, labels)


def heatmap_figure(attr: Attribution, inputs: list[int], layer: int | None = None, head: int | None = None) -> Figure:
    """One token×token panel per input (rows: target i, columns: source j) with its colour bar."""
    mats = [select_map(attr, b, layer, head) for b in inputs]
    n = max(m.shape[0] for m, _ in mats)
    side = float(np.clip(1.6 + 0.16 * n, 2.8, 9.0))
    with rc_context(STYLE):
        fig = Figure(figsize=(side * len(mats) + 0.8 * len(mats), side), layout="constrained")
        axes = fig.subplots(1, len(mats), squeeze=False)[0]
        for ax, b, (m, desc) in zip(axes, inputs, mats, strict=True):
            signed = m.min() < 0
            lim = float(np.abs(m).max()) or 1.0
            im = ax.imshow(
                m,
                cmap="RdBu_r" if signed else "viridis",
                vmin=-lim if signed else 0,
                vmax=lim,
                interpolation="nearest",
                aspect="equal",
            )
            _tick_labels(ax, attr.tokens[b], "x")
            _tick_labels(ax, attr.tokens[b], "y")
            ax.set_xlabel("source j")
            ax.set_ylabel("target i")
            ax.set_title(f"{attr.method} ({desc})" + (f" — input {b + 1}" if len(inputs) > 1 else ""))
            fig.colorbar(im, ax=ax, shrink=0.8, label=attr.method)
    return fig


def bipartite_figure(
    attr: Attribution, inputs: list[int], layer: int | None = None, head: int | None = None, max_links: int = 3000
) -> Figure:
    """Sources on the left, targets on the right; line width and opacity ∝ |value| / max (red +, blue −)."""
    mats = [select_map(attr, b, layer, head) for b in inputs]
    n = max(m.shape[0] for m, _ in mats)
    with rc_context(STYLE):
        fig = Figure(figsize=(3.2 * len(mats), float(np.clip(0.5 + 0.17 * n, 2.5, 14.0))), layout="constrained")
        axes = fig.subplots(1, len(mats), squeeze=False)[0]
        for ax, b, (m, desc) in zip(axes, inputs, mats, strict=True):
            k = m.shape[0]
            a = np.abs(m) / (np.abs(m).max() or 1.0)
            order = np.argsort(a, axis=None)[::-1][:max_links][::-1]  # strongest drawn last
            order = order[a.flat[order] >= 0.005]
            i, j = np.unravel_index(order, m.shape)
            segs = np.stack([np.stack([np.zeros_like(j), j], 1), np.stack([np.ones_like(i), i], 1)], 1)
            colors = np.where(m.flat[order][:, None] < 0, [[0.13, 0.4, 0.67]], [[0.7, 0.09, 0.17]])
            rgba = np.concatenate([colors, (0.1 + 0.9 * a.flat[order])[:, None]], 1)
            ax.add_collection(LineCollection(list(segs), colors=rgba, linewidths=0.3 + 2.5 * a.flat[order]))
            toks = [token_text(t) for t in attr.tokens[b]]
            for r in range(k):
                ax.text(-0.03, r, toks[r], ha="right", va="center")
                ax.text(1.03, r, toks[r], ha="left", va="center")
            ax.set_xlim(-0.5, 1.5)
            ax.set_ylim(k - 0.5, -0.5)
            ax.axis("off")
            ax.set_title(
                f"{attr.method} ({desc})" + (f" — input {b + 1}" if len(inputs) > 1 else "") + "\nsource j → target i"
            )
    return fig


def ratio_figure(analysis: Analysis, inputs: list[int] | None = None) -> Figure:
    """Per-layer context-mixing ratio for W, N, Res-W, Res-N, ResLN-N on one chart (Kobayashi et al. 2021,
    Fig. 3): mean over all real tokens of the chosen inputs (all by default)."""
    inputs = list(range(len(analysis.texts))) if inputs is None else inputs
    counts = np.array([len(analysis.tokens[b]) for b in inputs], dtype=float)
    with rc_context(STYLE):
        fig = Figure(figsize=(4.4, 2.6), layout="constrained")
        ax = fig.subplots()
        for c, (v, r) in enumerate(analysis.ratios.items()):
            mean = 100 * r[inputs].sum(-1).sum(0) / counts.sum()  # [layer], pooled over tokens
            ax.plot(np.arange(len(mean)), mean, marker="o", ms=3, lw=1.5, color=RATIO_COLORS[c % 5], label=v)
        ax.set_xlabel("layer")
        ax.set_ylabel("context-mixing ratio (%)")
        ax.set_ylim(0, 100)
        ax.set_xticks(np.arange(r.shape[1]))
        ax.grid(alpha=0.3)
        fig.legend(loc="outside right center", frameon=False)
        ax.set_title(f"{model_label(analysis.model)} — {counts.sum():.0f} tokens")
    return fig


def token_scores_figure(attr: Attribution, inputs: list[int], width_in: float = 7.0) -> Figure:
    """Per-token scores (dims [..., source], e.g. saliency or decompx_classes) as highlighted text: each token on a
    background whose colour and strength follow its score / max |score| of that row (red +, blue −); one row of
    text per input (and per class), wrapped to `width_in` inches."""
    from matplotlib import colormaps

    cmap = colormaps["RdBu_r"]
    char_in = 0.6 * 9 / 72  # monospace 9 pt: one character ≈ 0.6 em
    line_in = 0.28
    rows: list[tuple[str, list[str], np.ndarray]] = []
    for b in inputs:
        v = attr.input(b)  # [*lead, n]
        flat = v.reshape(-1, v.shape[-1])
        for k, r in enumerate(flat):
            label = f"input {b + 1}" if len(inputs) > 1 else ""
            if v.ndim > 1:
                label += f"{', ' if label else ''}{attr.dims[0]} {k}"
            rows.append((label, [token_text(t) for t in attr.tokens[b]], r))
    placed: list[tuple[float, float, str, float]] = []  # (x, line, token, score / max)
    titles: list[tuple[float, str]] = []
    line = 0.0
    for label, toks, r in rows:
        if label:
            titles.append((line, label))
            line += 1
        lim = float(np.abs(r).max()) or 1.0
        x = 0.0
        for t, val in zip(toks, r.tolist(), strict=False):
            w = (len(t) + 1.5) * char_in
            if x + w > width_in and x > 0:
                x, line = 0.0, line + 1
            placed.append((x, line, t, val / lim))
            x += w
        line += 1.4
    with rc_context(STYLE):
        fig = Figure(figsize=(width_in + 0.4, 0.5 + line_in * line), layout="constrained")
        ax = fig.subplots()
        ax.set_xlim(0, width_in)
        ax.set_ylim(line, -0.5)
        ax.axis("off")
        for y, label in titles:
            ax.text(0, y, label, fontweight="bold", va="center")
        for x, y, t, a in placed:
            ax.text(
                x,
                y,
                t,
                family="monospace",
                va="center",
                ha="left",
                color="white" if abs(a) > 0.6 else "black",  # readable on the dark ends of the scale
                bbox={"boxstyle": "round,pad=0.2", "facecolor": cmap(0.5 + 0.5 * a), "edgecolor": "none"},
            )
        ax.set_title(f"{attr.method} — colour: score / max |score| per row (red +, blue −)")
    return fig


def save_figure(fig: Figure, out: str | Path) -> None:
    """Write png/svg/pdf by suffix (atomically)."""
    import io

    out = Path(out)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise MixlensError(f"cannot write '{out.name}': the suffix must be one of .png, .svg, .pdf")
    buf = io.BytesIO()
    with rc_context(STYLE):
        fig.savefig(buf, format=fmt, dpi=300 if fmt == "png" else None, bbox_inches="tight")
    atomic_write(out, buf.getvalue())
