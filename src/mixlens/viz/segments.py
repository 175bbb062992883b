"""Views of an explanation's segments ("where did this answer come from?"): the ranked list of segments per method and
the answer tokens × segments heatmap, in the terminal (rich), as an HTML section and as a figure (matplotlib).

The heatmap is built over plain numpy (`mixlens.result.segmented.answer_segment_matrix`): an answer matrix
[answer, source] (row a: the context tokens' scores for answer token a) times the segments' membership
[source, segment], plus the tokens in no segment as a last 'outside' column. Every number is an exact sum of token
scores, so each row adds up to the answer token's total score. `answer_matrices` says which matrix each method gives
for an input: an explanation of one target is the case answer = 1 (its token scores, one row).

Colours follow the other views: signed scores (a finite negative value, `segmented.is_signed`) on a diverging scale
centred at 0 (red toward the target, blue against it), unsigned ones on a sequential scale from 0.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import numpy as np

from mixlens.result.segmented import ANSWER, OUTSIDE, Segment, answer_segment_matrix, is_signed
from mixlens.result.segmented import ranked as rank_segments
from mixlens.viz.highlight import diverging_rgb
from mixlens.viz.labels import model_label, token_text


@dataclass(frozen=True)
class AnswerSegments:
    """One method's answer × segment view of one input: the answer tokens (rows), the segment labels with
    'outside' last (columns) and the matrix [answer, segment + 1]."""

    method: str
    answer: list[str]
    labels: list[str]
    matrix: np.ndarray

    @property
    def signed(self) -> bool:
        return is_signed(self.matrix)

    @property
    def totals(self) -> np.ndarray:
        """[column] the answer-level segment scores (the sum over the answer's tokens)."""
        return self.matrix.sum(0)

    @property
    def segment_count(self) -> int:
        """The columns that are segments (the rest: '(answer)', '(outside)')."""
        return sum(label not in (ANSWER, OUTSIDE) for label in self.labels)

    def ranked(self) -> list[tuple[str, float]]:
        """(label, answer-level score) of the segments, highest first, then '(answer)' and '(outside)'."""
        k = self.segment_count
        rest = [(label, float(x)) for label, x in zip(self.labels[k:], self.totals[k:], strict=True)]
        return rank_segments(self.labels[:k], self.totals[:k]) + rest


def answer_segments(
    method: str, answer: list[str], scores: np.ndarray, segments: list[Segment], answer_start: int | None = None
) -> AnswerSegments:
    """The view of one method's answer matrix `scores` [answer, source] (or [source] for one target) over
    `segments`; `answer_start`: where the sources run on into the answer, the position of its first token."""
    matrix = answer_segment_matrix(scores, segments, answer_start)
    if len(answer) != matrix.shape[0]:
        raise ValueError(f"{len(answer)} answer tokens for a matrix of {matrix.shape[0]} rows")
    extra = [] if answer_start is None else [ANSWER]
    return AnswerSegments(method, list(answer), [*(s.label for s in segments), *extra, OUTSIDE], matrix)


def answer_matrices(e: Any) -> dict[str, tuple[list[str], np.ndarray, int | None]]:
    """method → (answer tokens, matrix [answer, source], the answer's first position or None) of one explained input
    (`Explained`). An explained answer (`e.answer`: its tokens and `start`; `e.matrix`: method → [answer, source] over
    prompt + answer) gives one row per answer token, a method without a matrix its answer-level scores as one row;
    an explanation of one target gives answer = 1: the target (− the foil) and the method's token scores."""
    answer, matrix = getattr(e, "answer", None), getattr(e, "matrix", None) or {}
    t = e.target
    row = t.label if t.foil is None else f"{t.label} − {t.foil_label}"  # a contrast: logit(target) − logit(foil)
    start = None if answer is None else int(answer["start"])
    out = {}
    for m, s in e.scores.items():
        if m in matrix and answer is not None:
            out[m] = (list(answer["tokens"]), np.asarray(matrix[m], dtype=np.float64), start)
            continue
        s = np.asarray(s, dtype=np.float64)
        if s.ndim == 1:
            out[m] = ([row if answer is None else f"{answer['text']} (sum)"], s[None], start)
    return out


def input_views(e: Any) -> list[AnswerSegments]:
    """One `AnswerSegments` per method of an explained input with segments."""
    return [answer_segments(m, a, x, e.segments, start) for m, (a, x, start) in answer_matrices(e).items()]


# ---- terminal ----


def print_segments(expl: Any, console: Any = None) -> None:
    """Each input's segments ranked by score, per method (the tokens in no segment summed as '(outside)' last), and
    — for an answer of several tokens — the answer × segments heatmap."""
    from rich.console import Console
    from rich.text import Text

    console = console or Console()
    for b, e in enumerate(expl.inputs):
        if e.segments is None:
            continue
        console.print(
            Text(f"\nsegments of input {b + 1} (score = sum of the segment's token scores), highest first:"),
            soft_wrap=True,
        )
        for v in input_views(e):
            width = max(len(label) for label in v.labels)
            console.print(Text(f"  {v.method}:"), soft_wrap=True)
            for label, value in v.ranked():
                console.print(Text(f"    {label:<{width}}  {value:+.4g}"), soft_wrap=True)
            if len(v.answer) > 1:
                console.print(heatmap_table(v))


def heatmap_table(v: AnswerSegments) -> Any:
    """A rich table of the answer × segments matrix: one row per answer token, one column per segment ('outside'
    last), cells coloured on the view's scale (scaled to the matrix's max |value|)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{v.method}: answer tokens × segments", show_lines=False)
    table.add_column("answer")
    for label in v.labels:
        table.add_column(Text(label), justify="right")
    lim = float(np.abs(v.matrix).max()) or 1.0
    for tok, row in zip(v.answer, v.matrix, strict=True):
        cells = []
        for x in row:
            r, g, b = diverging_rgb(float(x) / lim)
            fg = "white" if abs(x) / lim > 0.6 else "black"
            cells.append(Text(f"{float(x):+.3g}", style=f"{fg} on rgb({r},{g},{b})"))
        table.add_row(Text(token_text(tok)), *cells)
    return table


# ---- HTML ----

CSS = """
.mlx-report .mlx-seg { border-collapse: collapse; margin: 4px 0 12px; font-size: 12px; }
.mlx-report .mlx-seg th, .mlx-report .mlx-seg td { padding: 2px 6px; text-align: right; white-space: nowrap; }
.mlx-report .mlx-seg th:first-child, .mlx-report .mlx-seg td:first-child { text-align: left; }
.mlx-report .mlx-seg .mlx-bar { display: inline-block; height: 10px; vertical-align: middle; }
.mlx-report .mlx-seg-label { max-width: 28em; overflow: hidden; text-overflow: ellipsis; }
"""


def _cell(x: float, lim: float) -> str:
    r, g, b = diverging_rgb(x / lim if lim else 0.0)
    fg = "#fff" if lim and abs(x) / lim > 0.6 else "#1d1d1f"
    return f'<td style="background:rgb({r},{g},{b});color:{fg}" title="{x:.6g}">{x:+.3g}</td>'


def _ranked_html(v: AnswerSegments, text: str, segments: list[Segment]) -> str:
    lim = float(np.abs(v.totals).max()) or 1.0
    where = {s.label: text[s.char_start : s.char_end] for s in segments} | {ANSWER: "the answer's earlier tokens"}
    rows = []
    for label, value in v.ranked():
        r, g, b = diverging_rgb(value / lim)
        bar = f'<span class="mlx-bar" style="width:{abs(value) / lim * 120:.0f}px;background:rgb({r},{g},{b})"></span>'
        snippet = where.get(label, "tokens in no segment")
        rows.append(
            f'<tr><td class="mlx-seg-label" title="{html.escape(snippet)}">{html.escape(label)}</td>'
            f"<td>{value:+.4g}</td><td>{bar}</td></tr>"
        )
    return (
        f'<table class="mlx-seg"><caption>{html.escape(v.method)}: segments, highest first</caption>'
        f"<tr><th>segment</th><th>score</th><th></th></tr>{''.join(rows)}</table>"
    )


def heatmap_html(v: AnswerSegments) -> str:
    """The answer × segments matrix as an HTML table (rows: answer tokens; columns: segments, 'outside' last)."""
    lim = float(np.abs(v.matrix).max()) or 1.0
    head = "".join(f"<th>{html.escape(label)}</th>" for label in v.labels)
    rows = "".join(
        f"<tr><td>{html.escape(token_text(t))}</td>{''.join(_cell(float(x), lim) for x in row)}</tr>"
        for t, row in zip(v.answer, v.matrix, strict=True)
    )
    return (
        f'<table class="mlx-seg"><caption>{html.escape(v.method)}: answer tokens × segments '
        f"({'signed: red toward the answer token, blue against it' if v.signed else 'unsigned'})</caption>"
        f"<tr><th>answer token</th>{head}</tr>{rows}</table>"
    )


def render_html(expl: Any) -> str:
    """The HTML section of an explanation's segments ('' where it has none): per input and method, the ranked
    segments and the answer × segments heatmap."""
    if getattr(expl, "segments", None) is None:
        return ""
    parts = [
        f'<div class="mlx-report mlx-segments"><style>{CSS}</style>',
        "<h3>Segments: where did the answer come from?</h3>",
        "<p class=\"mlx-meta\">Each segment's score is the sum of its tokens' scores; the tokens in no segment (a chat "
        "template's own tokens, separators) are summed as '(outside)'. Hover a segment for its text.</p>",
    ]
    for b, e in enumerate(expl.inputs):
        parts.append(f"<h4>Input {b + 1}</h4>")
        for v in input_views(e):
            parts.append(_ranked_html(v, e.text, e.segments) + heatmap_html(v))
    parts.append("</div>\n")
    return "\n".join(parts)


# ---- figure ----


def segments_figure(expl: Any, inputs: list[int] | None = None) -> Any:
    """A figure of an explanation's segments: for each input and method, the ranked segments as bars (left) and the
    answer tokens × segments heatmap (right; diverging colour map centred at 0 for signed scores)."""
    from matplotlib import rc_context
    from matplotlib.figure import Figure

    from mixlens.viz.static import STYLE

    ex = expl.inputs
    inputs = [b for b in (range(len(ex)) if inputs is None else inputs) if ex[b].segments is not None]
    panels = [(b, v) for b in inputs for v in input_views(ex[b])]
    if not panels:
        raise ValueError("no input of this explanation has segments")
    n_seg = max(len(v.labels) for _, v in panels)
    n_ans = max(len(v.answer) for _, v in panels)
    width = float(np.clip(3.0 + 0.45 * n_seg, 6.0, 14.0))
    heights = [max(1.2 + 0.22 * len(v.labels), 0.9 + 0.25 * len(v.answer)) for _, v in panels]
    with rc_context(STYLE):
        fig = Figure(figsize=(width, sum(heights) + 0.4), layout="constrained")
        axes = fig.subplots(len(panels), 2, squeeze=False, height_ratios=heights, width_ratios=[1, 1.3])
        for (bars, heat), (b, v) in zip(axes, panels, strict=True):
            title = v.method + (f" — input {b + 1}" if len(inputs) > 1 else "")
            _bars(bars, v, title)
            _heatmap(fig, heat, v, n_ans)
        fig.suptitle(f"{model_label(expl.model)}: segment scores (sums of token scores)")
    return fig


def _bars(ax: Any, v: AnswerSegments, title: str) -> None:
    order = v.ranked()
    labels = [label for label, _ in order]
    values = np.array([x for _, x in order])
    colors = ["#999999" if k >= v.segment_count else "#b2182b" if x >= 0 else "#2166ac" for k, x in enumerate(values)]
    y = np.arange(len(values))
    ax.barh(y, values, color=colors)
    ax.set_yticks(y, [_short(x) for x in labels])
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.6)
    ax.set_xlabel("segment score")
    ax.set_title(title)


def _heatmap(fig: Any, ax: Any, v: AnswerSegments, n_ans: int) -> None:
    lim = float(np.abs(v.matrix).max()) or 1.0
    im = ax.imshow(
        v.matrix,
        cmap="RdBu_r" if v.signed else "viridis",
        vmin=-lim if v.signed else 0.0,
        vmax=lim,
        interpolation="nearest",
        aspect="auto",
    )
    ax.set_xticks(np.arange(len(v.labels)), [_short(x) for x in v.labels], rotation=45, ha="right")
    ax.set_yticks(np.arange(len(v.answer)), [token_text(t) for t in v.answer])
    ax.set_ylabel("answer token")
    ax.set_title("answer tokens × segments")
    fig.colorbar(im, ax=ax, shrink=0.9, label=v.method)


def _short(label: str, width: int = 24) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"
