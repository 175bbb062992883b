"""The information-flow routes of one prediction as a figure (matplotlib, Agg; `methods.flow_routes`).

Positions run left to right (token labels below), layers bottom to top: the embeddings at the bottom, the residual
stream after layer l at height l + 1, the stream after layer l's attention half-way between. Each kept edge is a
line whose width and opacity follow its importance: attention edges token j → i in blue, residual edges in grey,
the FFN node of a position as an orange square beside its stream (its size: the FFN edge's importance). The
prediction's node is a red star; the bars under the graph give each input token's route score.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

import numpy as np
from matplotlib import rc_context
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from mixlens.errors import MixlensError
from mixlens.result import Analysis, Attribution
from mixlens.viz.labels import model_label, token_text
from mixlens.viz.static import STYLE

ATTENTION, RESIDUAL, FFN, TARGET = "#1f77b4", "#7f7f7f", "#ff7f0e", "#d62728"
NEEDS = ("residual", "ffn", "ffn_residual", "nodes", "tokens", "position")  # extras of `flow_routes`
MAX_TOKENS = 80  # positions drawn (the prediction's context ends at its position)


def is_routes(attr: Attribution) -> bool:
    """Whether `attr` holds information-flow routes (the values and extras of `flow_routes`)."""
    return set(NEEDS) <= set(attr.extra_store) and attr.dims[-2:] == ("target", "source") and "layer" in attr.dims


def _width(imp: np.ndarray) -> np.ndarray:
    return 0.4 + 3.6 * imp


def _alpha(imp: np.ndarray) -> np.ndarray:
    return 0.25 + 0.75 * imp


def _lines(ax: Any, segs: list[np.ndarray], imps: list[float], color: str, z: int) -> None:
    if not segs:
        return
    imp = np.clip(np.asarray(imps), 0, 1)
    rgba = np.tile(np.array([int(color[k : k + 2], 16) / 255 for k in (1, 3, 5)] + [1.0]), (len(imp), 1))
    rgba[:, 3] = _alpha(imp)
    ax.add_collection(LineCollection(segs, linewidths=_width(imp), colors=rgba, zorder=z, capstyle="round"))


def _panel(ax: Any, bars: Any, attr: Attribution, b: int) -> None:
    v = attr.input(b)  # [L, (H,) m, m]
    edges = v.sum(1) if attr.dims == ("layer", "head", "target", "source") else v  # token-level: Σ over heads
    ex = {k: attr.extra_store[k].row(b) for k in NEEDS}
    n_layers, m = edges.shape[0], edges.shape[-1]
    pos = int(ex["position"])
    shown = min(m, pos + 1, MAX_TOKENS)
    first = pos + 1 - shown  # a long context shows the last MAX_TOKENS positions up to the prediction
    toks = [token_text(t) for t in attr.tokens[b][first : pos + 1]]
    att, res, ffn_lines = [], [], []
    att_w, res_w, ffn_w = [], [], []
    ffn_pts: list[tuple[float, float, float]] = []
    for layer in range(n_layers):
        y0, ym, y1 = layer, layer + 0.5, layer + 1.0
        rows, cols = np.nonzero(edges[layer])
        for i, j in zip(rows.tolist(), cols.tolist(), strict=True):
            if i >= first and j >= first:
                att.append(np.array([[j - first, y0], [i - first, ym]]))
                att_w.append(float(edges[layer, i, j]))
        for i in range(first, pos + 1):
            x = i - first
            if ex["residual"][layer, i] > 0:
                res.append(np.array([[x, y0], [x, ym]]))
                res_w.append(float(ex["residual"][layer, i]))
            if ex["ffn_residual"][layer, i] > 0:
                res.append(np.array([[x, ym], [x, y1]]))
                res_w.append(float(ex["ffn_residual"][layer, i]))
            if ex["ffn"][layer, i] > 0:
                f = float(ex["ffn"][layer, i])
                ffn_lines.append(np.array([[x, ym], [x + 0.3, layer + 0.75], [x, y1]]))
                ffn_w.append(f)
                ffn_pts.append((x + 0.3, layer + 0.75, f))
    _lines(ax, res, res_w, RESIDUAL, 1)
    _lines(ax, att, att_w, ATTENTION, 2)
    _lines(ax, ffn_lines, ffn_w, FFN, 2)
    if ffn_pts:
        fx, fy, fs = (np.array(c) for c in zip(*ffn_pts, strict=True))
        ax.scatter(fx, fy, s=8 + 40 * fs, marker="s", color=FFN, zorder=3, linewidths=0)
    nodes = ex["nodes"][:, first : pos + 1]
    ly, lx = np.nonzero(nodes)
    ax.scatter(lx, ly + 1.0, s=6, color="black", zorder=4, linewidths=0)
    inputs = attr.extra_store["inputs"].row(b)[first : pos + 1] if "inputs" in attr.extra_store else None
    if inputs is not None:
        ix = np.nonzero(inputs)[0]
        ax.scatter(ix, np.zeros(len(ix)), s=14, color="black", zorder=4, linewidths=0)
    ax.scatter([pos - first], [n_layers], s=90, marker="*", color=TARGET, zorder=5, linewidths=0)
    ax.set_xlim(-0.6, shown - 0.4)
    ax.set_ylim(-0.4, n_layers + 0.5)
    step = max(1, int(np.ceil((n_layers + 1) / 16)))
    ticks = list(range(0, n_layers + 1, step))
    ax.set_yticks(ticks, ["embeddings" if t == 0 else f"layer {t - 1}" for t in ticks])
    ax.tick_params(axis="x", which="both", bottom=False, labelbottom=False)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="y", alpha=0.15)
    tau = attr.params.get("tau")
    cut = f", last {shown} of {pos + 1} positions" if first else ""
    ax.set_title(
        f"input {b + 1}: prediction after {toks[-1].strip() or toks[-1]!r} (position {pos})"
        + (f", τ = {tau:g}" if isinstance(tau, int | float) else "")
        + cut,
        loc="left",
    )
    score = ex["tokens"][first : pos + 1]
    bars.bar(np.arange(shown), score, color=ATTENTION, width=0.7)
    bars.set_xlim(-0.6, shown - 0.4)
    bars.set_ylabel("route\nscore")
    for side in ("top", "right"):
        bars.spines[side].set_visible(False)
    step = max(1, int(np.ceil(shown / 80)))
    bars.set_xticks(np.arange(0, shown, step), toks[::step], rotation=90)


def routes_figure(attr: Attribution, inputs: list[int]) -> Figure:
    """The routes of each of `inputs` (one panel each, side by side): layers × positions, see the module doc."""
    if not is_routes(attr):
        raise MixlensError(f"'{attr.method}' holds no information-flow routes (analyse with --method flow_routes)")
    n_layers = attr.input(0).shape[0]
    widths = []
    for b in inputs:
        pos = int(attr.extra_store["position"].row(b))
        widths.append(min(pos + 1, MAX_TOKENS))
    w = sum(max(4.0, 0.32 * k + 1.4) for k in widths)
    h = min(18.0, max(4.0, 0.26 * (n_layers + 1) + 2.2))
    with rc_context(STYLE):
        fig = Figure(figsize=(w, h), layout="constrained")
        grid = fig.add_gridspec(2, len(inputs), height_ratios=[max(4.0, n_layers + 1), 2.2], width_ratios=widths)
        for k, b in enumerate(inputs):
            ax = fig.add_subplot(grid[0, k])
            bars = fig.add_subplot(grid[1, k], sharex=ax)
            _panel(ax, bars, attr, b)
        fig.legend(
            handles=[
                Line2D([], [], color=ATTENTION, lw=2, label="attention edge j → i"),
                Line2D([], [], color=RESIDUAL, lw=2, label="residual edge"),
                Line2D([], [], color=FFN, lw=2, marker="s", label="FFN node"),
                Line2D([], [], color=TARGET, lw=0, marker="*", markersize=10, label="prediction"),
            ],
            loc="outside lower center",
            ncols=4,
            frameon=False,
        )
        fig.suptitle(f"{attr.method} — {model_label(attr.model)}: line width and opacity = edge importance", fontsize=9)
    return fig


def routes_markup(analysis: Analysis | Attribution, max_inputs: int = 8) -> str:
    """HTML for a report: the routes figure of each input (PNG data URIs; the page's CSP allows data: images), or ''
    when the analysis holds no routes."""
    attrs = [analysis] if isinstance(analysis, Attribution) else list(analysis.attributions.values())
    found = [a for a in attrs if is_routes(a)]
    if not found:
        return ""
    parts = ['<div class="mlx-report mlx-routes"><h3>Information-flow routes</h3>']
    for a in found:
        shown = list(range(min(len(a), max_inputs)))
        for b in shown:
            buf = io.BytesIO()
            fig = routes_figure(a, [b])
            with rc_context(STYLE):
                fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
            data = base64.b64encode(buf.getvalue()).decode()
            parts.append(
                f'<figure><img alt="{html.escape(a.method)}, input {b + 1}" style="max-width:100%" '
                f'src="data:image/png;base64,{data}"></figure>'
            )
        if len(a) > len(shown):
            parts.append(f"<p>{html.escape(a.method)}: the first {len(shown)} of {len(a)} inputs are drawn.</p>")
    parts.append("</div>\n")
    return "".join(parts)
