"""The terminal view (rich) of an `Explanation` (`Explanation.show`, `mixlens explain`): each input's tokens with one
coloured score row per method, on the diverging scale of the HTML view (`mixlens.viz.highlight`)."""

from __future__ import annotations

import shutil
from typing import Any

import numpy as np

from mixlens.viz.highlight import diverging_rgb, position_note, scaled_scores, target_header
from mixlens.viz.labels import token_text
from mixlens.viz.segments import print_segments


def show_explanation(expl: Any, console: Any = None) -> None:
    """Each input: the target, then the tokens in aligned columns with one coloured score row per method,
    wrapped to the terminal width."""
    from rich.console import Console
    from rich.text import Text

    from mixlens.methods.rollout import DISPLAY_NOTE, display_rows

    console = console or Console(width=shutil.get_terminal_size((120, 24)).columns)
    width = console.width
    for k, e in enumerate(expl.inputs):
        console.print(Text(f"{k + 1}. {e.text}", style="bold"))
        console.print(f"   {target_header(e)}")
        label = max(len(m) for m in e.scores) + 2
        noted = False
        tokens = [token_text(t) for t in e.tokens]
        cols = [max(9, min(16, len(t)) + 1) for t in tokens]
        start = 0
        while start < len(tokens):
            stop, used = start, label
            while stop < len(tokens) and (stop == start or used + cols[stop] <= width):
                used += cols[stop]
                stop += 1
            head = Text(" " * label)
            for t, c in zip(tokens[start:stop], cols[start:stop], strict=True):
                head.append(t[: c - 1].rjust(c - 1) + " ", style="bold")
            console.print(head)
            for m, s in e.scores.items():
                s, norm = display_rows(m, np.asarray(s, dtype=float))
                noted |= norm
                row = Text((m + ("*" if norm else "")).ljust(label))
                scaled = scaled_scores(s)
                for j in range(start, stop):
                    r, g, b = diverging_rgb(float(scaled[j]))
                    fg = "white" if abs(scaled[j]) > 0.6 else "black"
                    cell = f"{float(s[j]):+.2g}"[: cols[j] - 1].rjust(cols[j] - 1)
                    row.append(cell, style=f"{fg} on rgb({r},{g},{b})")
                    row.append(" ")
                console.print(row)
            start = stop
        if e.answer is not None:
            show_answer_rows(e, console)
        if noted:
            console.print(f"   * {DISPLAY_NOTE}", style="dim")
        if position_note(expl):
            console.print(f"   note: {position_note(expl)}", style="dim")
        console.print()


TOP_SOURCES = 3  # sources listed per answer token


def show_answer_rows(e: Any, console: Any) -> None:
    """An explained answer: per answer token, its log-probability and each method's top sources (by |score|)."""
    from rich.text import Text

    tokens = [token_text(t) for t in e.tokens]
    for a, (tok, lp) in enumerate(zip(e.answer["tokens"], e.answer["logprobs"], strict=True)):
        console.print(Text(f"   {token_text(tok)!r} (log p {lp:.3f})", style="bold"))
        for m, mat in e.matrix.items():
            row = np.asarray(mat[a], dtype=float)
            top = np.argsort(-np.abs(row), kind="stable")[:TOP_SOURCES]
            listed = ", ".join(f"{tokens[j]!r} {row[j]:+.2g}" for j in top if row[j] != 0)
            console.print(f"     {m}: {listed}")
    if getattr(expl, "segments", None) is not None:
        print_segments(expl, console)
