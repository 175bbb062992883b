"""Figures of per-head results: layer × head heatmaps, the MDS map of head distances, pattern-type shares per
layer, and attention (local) vs head attribution (global) agreement.

Drawn on `matplotlib.figure.Figure` without pyplot (no global backend, no display needed).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from mixlens.result import atomic_write

RASTER_DPI = 110


def save(fig: Figure, path: str | Path, dpi: int | None = RASTER_DPI) -> None:
    """Write the figure (format from the suffix) atomically, creating the parent directory; a write that fails
    is a `MixlensError` naming the path."""
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lower().lstrip(".") or "png", dpi=dpi)
    atomic_write(path, buf.getvalue())


def layer_head_heatmap(
    grid: np.ndarray, title: str, path: str | Path, cmap: str = "viridis", center: bool = False
) -> None:
    """A [layer, head] grid (extra columns allowed) as a heatmap with each value written in its cell; `center`
    makes the colour scale symmetric around 0."""
    fig = Figure(figsize=(0.55 * grid.shape[1] + 2, 0.45 * grid.shape[0] + 1.5))
    ax = fig.subplots()
    lim = np.nanmax(np.abs(grid)) if center else None
    im = ax.imshow(grid, cmap=cmap, aspect="auto", vmin=-lim if lim is not None else None, vmax=lim)
    for (r, c), v in np.ndenumerate(grid):
        ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6, color="k" if center else "w")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(grid.shape[1]))
    ax.set_yticks(range(grid.shape[0]))
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    save(fig, path)


def head_mds_figure(
    coords: np.ndarray,
    layers: np.ndarray,
    heads: np.ndarray,
    behaviours: np.ndarray,
    names: list[str],
    title: str,
    path: str | Path,
) -> None:
    """Heads as points in 2-D (`coords` [L·H, 2], e.g. classical MDS of Jensen–Shannon distances), coloured by
    their dominant behaviour (`behaviours` [L·H], one of `names`) and labelled layer-head."""
    fig = Figure(figsize=(7, 6))
    ax = fig.subplots()
    tab10 = colormaps["tab10"]
    for k, beh in enumerate(names):
        sel = behaviours == beh
        if sel.any():
            ax.scatter(coords[sel, 0], coords[sel, 1], label=beh, color=tab10(k), s=30)
    for i, (la, h) in enumerate(zip(layers, heads, strict=True)):
        ax.annotate(f"{la}-{h}", coords[i], fontsize=5, alpha=0.7)
    ax.legend(title="dominant behaviour", fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save(fig, path)


def pattern_shares_figure(
    shares: np.ndarray, patterns: tuple[str, ...] | list[str], title: str, path: str | Path
) -> None:
    """Stacked bars per layer of the share of each pattern type (`shares` [layer, pattern], rows sum to 1)."""
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    tab10 = colormaps["tab10"]
    bottom = np.zeros(shares.shape[0])
    for k, p in enumerate(patterns):
        ax.bar(range(shares.shape[0]), shares[:, k], bottom=bottom, label=p, color=tab10(k))
        bottom += shares[:, k]
    ax.set_xlabel("layer")
    ax.set_ylabel("share of heads × inputs")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    save(fig, path)


def local_global_figure(res: Any, path: str | Path) -> None:
    """For a `mixlens.stats.agreement.LocalGlobal`: JS divergence per (layer, head), the per-layer means of JS,
    Pearson and Spearman, and per-layer token-type masses of attention (solid) and head attribution (dashed)."""
    from mixlens.stats.tokens import TOKEN_TYPES

    fig = Figure(figsize=(15, 4))
    ax = fig.subplots(1, 3)
    im = ax[0].imshow(res.scores["js"], aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax[0].set(title="JS(attention, head attribution)", xlabel="head", ylabel="layer")
    fig.colorbar(im, ax=ax[0])
    layers = np.arange(res.scores["js"].shape[0])
    ax[1].plot(layers, res.js_per_layer(), marker="o", label="JS")
    ax[1].plot(layers, res.scores["spearman"].mean(1), marker="s", label="Spearman")
    ax[1].plot(layers, res.scores["pearson"].mean(1), marker="^", label="Pearson")
    ax[1].set(title="mean over heads", xlabel="layer")
    ax[1].legend()
    for k, t in enumerate(TOKEN_TYPES):
        color = f"C{k}"
        ax[2].plot(layers, res.local[t].mean(1), color=color, marker="o", label=f"{t} (attention)")
        ax[2].plot(layers, res.global_[t].mean(1), color=color, ls="--", marker="x", label=f"{t} (global)")
    ax[2].set(title="token-type mass, mean over heads", xlabel="layer")
    ax[2].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save(fig, path, dpi=None)
