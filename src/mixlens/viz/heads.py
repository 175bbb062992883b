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


VIEW_WORDS = {"attn": "attention weights", "norm": "norm-based contributions ‖αf(x)‖"}
STAT_WORDS = {
    "cls": "mass on [CLS]",
    "sep": "mass on [SEP]",
    "punct": "mass on punctuation",
    "self": "mass on the token itself",
    "prev": "mass on the previous token",
    "next": "mass on the next token",
    "entropy": "row entropy (nats)",
    "cls_colmax": "max column mean on [CLS]",
    "sep_colmax": "max column mean on [SEP]",
    "punct_colmax": "max column mean on punctuation",
}


def statistic_words(column: str) -> str:
    """A head-statistics column (`attn_cls`, `norm_entropy`, ...) in words."""
    view, _, stat = column.partition("_")
    return f"{STAT_WORDS.get(stat, stat)}, {VIEW_WORDS.get(view, view)}"


def _number(v: float, digits: int = 2) -> str:
    """A cell label without "-0.00": values that round to zero print unsigned."""
    text = f"{v:.{digits}f}"
    return text.lstrip("-") if float(text) == 0 else text


def _text_colour(rgba: tuple[float, ...]) -> str:
    """Black on light cells, white on dark ones (relative luminance of the cell colour, sRGB)."""
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3]]
    return "k" if 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2] > 0.18 else "w"


def _annotated(ax: Any, grid: np.ndarray, cmap: str, vmin: float | None, vmax: float | None, digits: int = 2) -> Any:
    """imshow of `grid` with each value written in its cell in a colour readable on that cell."""
    im = ax.imshow(grid, cmap=cmap, aspect="auto", vmin=vmin, vmax=vmax)
    for (r, c), v in np.ndenumerate(grid):
        if np.isfinite(v):
            colour = _text_colour(im.cmap(im.norm(v)))
            ax.text(c, r, _number(v, digits), ha="center", va="center", fontsize=6, color=colour)
    ax.set_yticks(range(grid.shape[0]))
    return im


def layer_head_heatmap(
    grid: np.ndarray,
    title: str,
    path: str | Path,
    cmap: str = "viridis",
    center: bool = False,
    label: str = "",
) -> None:
    """A [layer, head] grid as a heatmap with each value written in its cell (text colour by cell luminance);
    `center` makes the colour scale symmetric around 0; `label` names the colour bar."""
    fig = Figure(figsize=(0.55 * grid.shape[1] + 2, 0.45 * grid.shape[0] + 1.5))
    ax = fig.subplots()
    lim = float(np.nanmax(np.abs(grid))) if center else None
    im = _annotated(ax, grid, cmap, -lim if lim is not None else None, lim)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(grid.shape[1]))
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    save(fig, path)


def sweep_figure(res: Any, path: str | Path) -> None:
    """A `SweepResult`: metric change with one head disabled (layer × head) and, in its own panel, with the
    whole layer disabled; one colour scale centred on 0 (red = worse)."""
    heads, layers = res.delta_heads, res.delta_layers[:, None]
    lim = float(np.nanmax(np.abs(np.concatenate([heads, layers], 1)))) or 1.0
    cmap = "RdBu" if res.higher_is_better else "RdBu_r"
    n_layers, n_heads = heads.shape
    fig = Figure(figsize=(0.65 * n_heads + 3.6, 0.45 * n_layers + 1.8))
    ax_h, ax_l = fig.subplots(1, 2, gridspec_kw={"width_ratios": [n_heads, 1.6]}, sharey=True)
    im = _annotated(ax_h, heads, cmap, -lim, lim, digits=3)
    ax_h.set(xlabel="head", ylabel="layer", title="one head disabled")
    ax_h.set_xticks(range(n_heads))
    _annotated(ax_l, layers, cmap, -lim, lim, digits=3)
    ax_l.set(xticks=[], title="whole layer")
    names = {"spearman": "Spearman ρ", "accuracy": "accuracy", "mlm_loss": "masked-LM loss"}
    metric = names.get(res.metric, res.metric)
    fig.suptitle(
        f"Change of {metric} when disabling heads ({res.mode} ablation; baseline {res.baseline:.3f}, "
        f"{res.n_examples} examples)",
        fontsize=9,
    )
    fig.colorbar(im, ax=[ax_h, ax_l], label=f"{metric}, ablated − baseline", fraction=0.05, pad=0.03)
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
    their dominant behaviour (`behaviours` [L·H], one of `names`) and labelled L{layer}H{head}."""
    fig = Figure(figsize=(9, 7))
    ax = fig.subplots()
    tab10 = colormaps["tab10"]
    for k, beh in enumerate(names):
        sel = behaviours == beh
        if sel.any():
            ax.scatter(coords[sel, 0], coords[sel, 1], label=beh, color=tab10(k), s=30)
    for i, (la, h) in enumerate(zip(layers, heads, strict=True)):
        ax.annotate(f"L{la}H{h}", coords[i], xytext=(3, 2), textcoords="offset points", fontsize=6.5)
    ax.set(xlabel="MDS dimension 1", ylabel="MDS dimension 2")
    ax.legend(title="dominant behaviour", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save(fig, path)


def pattern_shares_figure(
    shares: np.ndarray, patterns: tuple[str, ...] | list[str], title: str, path: str | Path
) -> None:
    """Stacked bars per layer of the share of each pattern type (`shares` [layer, pattern], rows sum to 1); the
    legend sits outside the bars."""
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    tab10 = colormaps["tab10"]
    bottom = np.zeros(shares.shape[0])
    for k, p in enumerate(patterns):
        ax.bar(range(shares.shape[0]), shares[:, k], bottom=bottom, label=p, color=tab10(k))
        bottom += shares[:, k]
    ax.set_xticks(range(shares.shape[0]))
    ax.set_xlabel("layer")
    ax.set_ylabel("share of (head, input) maps")
    ax.set_title(title, fontsize=9)
    ax.legend(title="pattern type", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    save(fig, path)


def pattern_ablation_figure(res: Any, path: str | Path) -> None:
    """A `PatternAblation`: per pattern type, the metric change with all its heads disabled next to the mean ± sd
    of as many random heads."""
    rows = res.rows()
    x = np.arange(len(rows))
    fig = Figure(figsize=(1.5 * len(rows) + 3, 4))
    ax = fig.subplots()
    ax.bar(x - 0.2, [r[3] for r in rows], 0.4, label="heads of the type", color="C3")
    ax.bar(
        x + 0.2,
        [r[4] for r in rows],
        0.4,
        yerr=[r[5] for r in rows],
        capsize=3,
        label=f"as many random heads (mean ± sd, {res.draws} draws)",
        color="C7",
    )
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(x, [f"{r[0]}\n({r[1]} head{'' if r[1] == 1 else 's'})" for r in rows], fontsize=8)
    names = {"spearman": "Spearman ρ", "accuracy": "accuracy", "mlm_loss": "masked-LM loss"}
    ax.set_ylabel(f"change of {names.get(res.metric, res.metric)}")
    ax.set_title(
        f"Disabling all heads of one pattern type ({res.mode} ablation; baseline {res.baseline:.3f})", fontsize=9
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
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
