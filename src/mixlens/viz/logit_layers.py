"""The per-layer contribution view of ALTI-Logit (Ferrando et al., ACL 2023, Fig. 1): for one explained prediction,
one row per layer — each context token's contribution to the target logit (or logit difference target − foil)
through that layer's attention (`alti_logit`: carried back to the input tokens; `logit_attn`: direct) — and the
summed row last; tokens coloured by signed contribution (red: toward the target, blue: toward the foil / against),
the target and the foil named with their probabilities. HTML (explain's page) and a matplotlib figure.

The layer rows share one colour scale (the largest |value| of any layer row), the summed row has its own.
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np
from matplotlib import rc_context
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from mixlens import catalog
from mixlens.errors import MixlensError
from mixlens.viz.labels import token_text
from mixlens.viz.static import STYLE

MAX_TOKENS = 60


def layered_methods() -> list[str]:
    """The methods this view draws: those whose registry entry declares an extra `layers` [layer, source] (read from
    the shipped catalog, so drawing needs no torch)."""
    return [m["name"] for m in catalog.load() if m["extras"].get("layers") == ["layer", "source"]]


def layered(e: Any) -> list[str]:
    """The methods of an explained input (`result.Explained`) that carry per-layer rows."""
    return [m for m in layered_methods() if "layers" in e.extras.get(m, {})]


def caption(e: Any) -> str:
    """'target ' sketch' (p = 0.031) vs foil ' sketches' (p = 0.004); logit difference 1.23'."""
    t = e.target

    def p(v: float | None) -> str:
        return "" if v is None else f" (p = {v:.3g})"

    prob = e.probability if e.probability is not None or t.foil is not None else e.score  # no foil: score = f(x)
    out = f"target '{t.label}'{p(prob)}"
    if t.foil is not None:
        out += f" vs foil '{t.foil_label}'{p(e.foil_probability)}; logit difference {e.score:.4g}"
    return out


def rows(e: Any, method: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(layer rows [L, m], summed row [m], first shown position): the context up to the target position, at most
    its last MAX_TOKENS tokens."""
    layers = np.asarray(e.extras[method]["layers"], dtype=float)
    n = layers.shape[1]
    total = np.asarray(e.scores[method], dtype=float)[:n]
    first = max(0, n - MAX_TOKENS)
    return layers[:, first:], total[first:], first


def closing(e: Any, method: str) -> str:
    """How the summed row closes to the explained logit (difference): 'Σ tokens 2.41 (shown 2.3 + earlier 0.11) +
    rest 1 (embedding, biases, MLPs) = 3.41 = the logit difference'. The method's `remainder` extra is everything
    but the per-source attention terms, so Σ_j score_j + remainder is the model's logit (difference)."""
    layers, total, first = rows(e, method)
    every = float(np.asarray(e.scores[method], dtype=float)[: first + layers.shape[1]].sum())
    shown = float(total.sum())
    extras = e.extras.get(method, {})
    tokens = f"Σ tokens {every:.4g}" + (f" (shown {shown:.4g} + earlier {every - shown:.4g})" if first else "")
    if "remainder" not in extras:
        return tokens
    rest = float(np.asarray(extras["remainder"], dtype=float).reshape(-1)[0])
    what = "the logit difference" if e.target.foil is not None else "the target's logit"
    return f"{tokens} + rest {rest:.4g} (embedding, biases, MLPs) = {every + rest:.4g}, {what}"


def _rgb(v: float) -> tuple[int, int, int]:
    v = max(-1.0, min(1.0, v))
    end = (178, 24, 43) if v >= 0 else (33, 102, 172)
    a = abs(v)
    return tuple(round(255 + (c - 255) * a) for c in end)  # type: ignore[return-value]


_CSS = """
.mlx-report .mlx-ll { border-collapse: collapse; margin: 2px 0 14px; }
.mlx-report .mlx-ll th { text-align: right; font-weight: 500; font-size: 11px; padding: 0 6px 0 0;
  white-space: nowrap; }
.mlx-report .mlx-ll td { padding: 1px 2px; font-family: ui-monospace, SFMono-Regular, Menlo, monospace;
  font-size: 11px; text-align: center; white-space: pre; }
.mlx-report .mlx-ll tr.mlx-sum th, .mlx-report .mlx-ll tr.mlx-sum td { border-top: 2px solid #555; font-weight: 600; }
"""


def render_html(e: Any, method: str) -> str:
    """One table: a header row of tokens, one row per layer, the summed row last."""
    layers, total, first = rows(e, method)
    toks = [token_text(t) for t in e.tokens[first : first + layers.shape[1]]]
    top = float(np.abs(layers).max()) or 1.0
    top_sum = float(np.abs(total).max()) or 1.0

    def cells(values: np.ndarray, scale: float, label: str) -> str:
        out = []
        for tok, v in zip(toks, values.tolist(), strict=True):
            w = v / scale
            r, g, b = _rgb(w)
            fg = "#fff" if abs(w) > 0.6 else "#1d1d1f"
            out.append(
                f'<td style="background:rgb({r},{g},{b});color:{fg}" '
                f'title="{html.escape(label)} · {html.escape(tok)}: {v:.4g}">{html.escape(tok)}</td>'
            )
        return "".join(out)

    parts = [
        f'<p class="mlx-meta">{html.escape(method)} per layer — {html.escape(caption(e))}; layer rows on one '
        f"colour scale (max |value| {top:.3g}), the sum on its own ({top_sum:.3g}); hover a token for its value</p>",
        '<table class="mlx-ll">',
    ]
    for k, row in enumerate(layers):
        parts.append(f"<tr><th>layer {k}</th>{cells(row, top, f'layer {k}')}</tr>")
    parts.append(f'<tr class="mlx-sum"><th>sum</th>{cells(total, top_sum, "sum")}</tr></table>')
    parts.append(f'<p class="mlx-meta">{html.escape(closing(e, method))}</p>')
    return "\n".join(parts)


def css() -> str:
    return _CSS


def logit_layers_figure(expl: Any, inputs: list[int], method: str | None = None, width_in: float = 9.0) -> Figure:
    """One panel per input: a heatmap of layers × tokens (signed, one symmetric colour scale per panel) and, below
    it, the summed row with its values (its own scale); the title names the target and foil with probabilities."""
    from matplotlib import colormaps

    all_inputs = expl.inputs
    panels = []
    for b in inputs:
        e = all_inputs[b]
        have = layered(e)
        if not have or (method is not None and method not in have):
            raise MixlensError(
                f"input {b + 1} has no per-layer rows of {method or ' or '.join(layered_methods())}: explain it with "
                "--method alti_logit (or logit_attn)"
            )
        m = method or have[0]
        panels.append((e, m, *rows(e, m)))
    cmap = colormaps["RdBu_r"]
    heights = []
    for _, _, layers, _, _ in panels:
        heights += [max(1.6, 0.22 * layers.shape[0]), 0.45]
    max_tokens = max(p[2].shape[1] for p in panels)
    width = max(width_in, 1.6 + 0.55 * max_tokens)
    with rc_context(STYLE):
        fig = Figure(figsize=(width, 1.2 * len(panels) + sum(heights)), layout="constrained")
        axes = fig.subplots(2 * len(panels), 1, gridspec_kw={"height_ratios": heights}, squeeze=False)[:, 0]
        for k, (e, m, layers, total, first) in enumerate(panels):
            ax, ax_sum = axes[2 * k], axes[2 * k + 1]
            toks = [token_text(t) for t in e.tokens[first : first + layers.shape[1]]]
            top = float(np.abs(layers).max()) or 1.0
            im = ax.imshow(layers, cmap=cmap, norm=TwoSlopeNorm(0.0, -top, top), aspect="auto", interpolation="none")
            ax.set_yticks(range(layers.shape[0]), [str(i) for i in range(layers.shape[0])])
            if layers.shape[0] > 16:  # label every few layers
                step = int(np.ceil(layers.shape[0] / 12))
                ax.set_yticks(range(0, layers.shape[0], step), [str(i) for i in range(0, layers.shape[0], step)])
            ax.set_ylabel("layer")
            ax.set_xticks(range(len(toks)), toks, rotation=60, ha="right", family="monospace", fontsize=8)
            ax.tick_params(axis="x", labelbottom=False, labeltop=True, bottom=False, top=True)
            plt_title = f"{'input ' + str(inputs[k] + 1) + ': ' if len(panels) > 1 else ''}{m} per layer — {caption(e)}"
            ax.set_title(plt_title, fontsize=9, loc="left")
            fig.colorbar(im, ax=ax, fraction=0.025, pad=0.01, label="contribution")
            top_sum = float(np.abs(total).max()) or 1.0
            im_sum = ax_sum.imshow(
                total[None], cmap=cmap, norm=TwoSlopeNorm(0.0, -top_sum, top_sum), aspect="auto", interpolation="none"
            )
            fig.colorbar(im_sum, ax=ax_sum, fraction=0.025, pad=0.01, ticks=[-top_sum, 0, top_sum], format="%.2g")
            ax_sum.set_yticks([0], ["sum"])
            ax_sum.set_xticks(range(len(toks)), toks, rotation=60, ha="right", family="monospace", fontsize=8)
            ax_sum.set_xlabel(closing(e, m), fontsize=8, loc="left")
            for j, v in enumerate(total.tolist()):
                ax_sum.text(
                    j,
                    0,
                    f"{v:.2g}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if abs(v) / top_sum > 0.6 else "black",
                )
    return fig
