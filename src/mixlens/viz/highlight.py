"""Text-highlight views of `mixlens.explain.Explanation`: self-contained HTML here, the terminal view in
`mixlens.viz.terminal.explanation` (it shares this scale).

Scores are signed, so both views use a diverging scale per method and input: red = toward the target, blue =
against it, white = 0, full colour at that method's max |score| on the input.
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np

from mixlens import catalog
from mixlens.viz.labels import token_text

_CSS = """
.mlx-report .mlx-hl { border-collapse: collapse; margin: 4px 0 12px; }
.mlx-report .mlx-hl th { text-align: right; font-weight: 600; padding: 2px 8px 2px 0; white-space: nowrap; }
.mlx-report .mlx-hl td { padding: 0; }
.mlx-report .mlx-tok { display: inline-block; padding: 1px 3px; margin: 1px; border-radius: 3px; cursor: default;
  font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px; }
.mlx-report .mlx-target { font-weight: 600; }
"""


def diverging_rgb(v: float) -> tuple[int, int, int]:
    """v in [-1, 1] → white-centred diverging colour (blue < 0 < red)."""
    v = max(-1.0, min(1.0, v))
    end = (178, 24, 43) if v >= 0 else (33, 102, 172)
    a = abs(v)
    return tuple(round(255 + (c - 255) * a) for c in end)  # type: ignore[return-value]


def scaled_scores(s: np.ndarray) -> np.ndarray:
    top = float(np.abs(s).max()) if s.size else 0.0
    return s / top if top > 0 else np.zeros_like(s)


def position_only(expl: Any) -> list[str]:
    """The methods of an explanation with a requested target or a foil that read neither: the registry declares no
    `target` option for them (maps read at the prediction's row, `flow_routes_tokens`), so their scores explain the
    predicted position, the same for any target or foil (read from the shipped catalog: no torch)."""
    requested = any(
        a.params.get("target", "pred") != "pred" or a.params.get("foil") is not None for a in expl.attributions.values()
    )
    if not requested:
        return []
    takes = catalog.option_names()
    return [m for m in expl.attributions if m in takes and "target" not in takes[m]]


def position_note(expl: Any) -> str:
    """One line naming the `position_only` methods, or ''."""
    names = position_only(expl)
    if not names:
        return ""
    return (
        f"{', '.join(names)}: take no target; {'they explain' if len(names) > 1 else 'it explains'} the predicted "
        "position, not the target and foil (the same scores for any of them)"
    )


def target_header(e) -> str:
    t = e.target
    if getattr(e, "answer", None) is not None:  # an explained answer: scores summed over its tokens
        n = len(e.answer["ids"])
        return f"answer: '{t.label}' ({n} token{'s' * (n != 1)}), log-probability {e.score:.4f}; scores summed over it"
    what = f"{t.kind} '{t.label}'" + (f" vs foil '{t.foil_label}'" if t.foil is not None else "")
    if t.kind == "phrase":  # a multi-token target: Σ log p over its tokens (minus the foil phrase's)
        return f"target: {what}, summed log-probability{' difference' if t.foil is not None else ''} {e.score:.4f}"
    name = "logit difference" if t.foil is not None else ("cosine" if t.kind == "embedding" else "probability")
    return f"target: {what}, {name} {e.score:.4f}"


def render_fragment(expl) -> str:
    """An HTML fragment (own CSS) with one table per input: one row per method, tokens coloured by score."""
    from mixlens.viz import logit_layers, segments

    parts = [
        f'<div class="mlx-report"><style>{_CSS}{logit_layers.css()}</style>',
        f"<h2>Explanations — {html.escape(expl.model)}</h2>",
        '<p class="mlx-meta">'
        + (
            "signed methods: red toward the target, blue against it; "
            if any((np.asarray(s) < 0).any() for e in expl.inputs for s in e.scores.values())
            else ""
        )
        + "unsigned methods (norms, weights, saliency): deeper red = larger; colour scaled to each method's "
        "max |score| on the input; hover a token for its value</p>",
    ]
    note = position_note(expl)
    if note:
        parts.append(f'<p class="mlx-meta">Note: {html.escape(note)}</p>')
    for k, e in enumerate(expl.inputs):
        parts.append(
            f'<p class="mlx-text">{k + 1}. {html.escape(e.text)} — '
            f'<span class="mlx-target">{html.escape(target_header(e))}</span></p><table class="mlx-hl">'
        )
        for m, s in e.scores.items():
            cells = []
            for tok, v, w in zip(map(token_text, e.tokens), s, scaled_scores(np.asarray(s, dtype=float)), strict=True):
                r, g, b = diverging_rgb(float(w))
                fg = "#fff" if abs(w) > 0.6 else "#1d1d1f"
                cells.append(
                    f'<span class="mlx-tok" style="background:rgb({r},{g},{b});color:{fg}" '
                    f'title="{html.escape(m)} · {html.escape(tok)}: {float(v):.4g}">{html.escape(tok)}</span>'
                )
            parts.append(f"<tr><th>{html.escape(m)}</th><td>{''.join(cells)}</td></tr>")
        parts.append("</table>")
        for m in logit_layers.layered(e):  # ALTI-Logit's per-layer view: one row per layer, the sum last
            parts.append(logit_layers.render_html(e, m))
    parts.append(segments.render_html(expl))  # the segments, where explain was given some
    parts.append("</div>")
    return "\n".join(parts)


def render_page(expl) -> str:
    """A self-contained HTML page (no scripts, no external resources)."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f"<title>mixlens explain — {html.escape(expl.model)}</title></head>\n<body>\n"
        f"{render_fragment(expl)}\n</body></html>\n"
    )
