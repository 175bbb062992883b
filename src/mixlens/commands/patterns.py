"""`mixlens patterns`: Kovaleva pattern types of the heads per layer over a dataset (docs/bertology.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from mixlens.commands.options import (
    batch_size_option,
    check_limit,
    check_view,
    data_option,
    figures_option,
    gguf_file_option,
    limit_option,
    model_option,
    out_dir_option,
    pair_column_option,
    read_examples,
    table_format_option,
    text_column_option,
    view_option,
)
from mixlens.commands.output import TableFormat, print_frame, progress, write_table


def register(app: typer.Typer) -> None:
    app.command("patterns")(patterns)


def patterns(
    data: str = data_option(),
    model: str | None = model_option(),
    gguf_file: str | None = gguf_file_option(),
    text_column: str | None = text_column_option(),
    pair_column: str | None = pair_column_option(),
    limit: int | None = limit_option(),
    batch_size: int = batch_size_option(),
    view: str = view_option(),
    fmt: TableFormat = table_format_option(),
    out: Path = out_dir_option("mixlens-patterns", "Directory for table and figure."),
    figures: bool = figures_option("Also write the figure patterns.png to --out."),
) -> None:
    """Share of each Kovaleva pattern type (vertical, diagonal, ...) per layer over a dataset."""
    import pandas as pd

    from mixlens.lens import load
    from mixlens.stats.patterns import PATTERNS, classify_inputs, pattern_shares
    from mixlens.viz.heads import VIEW_WORDS, pattern_shares_figure

    check_view(view)
    texts = [ex.text for ex in read_examples(data, text_column, pair_column, check_limit(limit))]
    lens = load(model, gguf_file=gguf_file)
    with progress(len(texts), "patterns") as step:
        labels = classify_inputs(lens, texts, view=view, batch_size=batch_size, on_batch=step)
    shares = pattern_shares(labels)  # [layer, pattern]
    df = pd.DataFrame(shares, columns=list(PATTERNS))
    df.insert(0, "layer", range(len(df)))
    write_table(df, fmt, out, "patterns")
    if fmt is TableFormat.table:
        print_frame(df, f"Pattern-type share per layer ({view}) — {lens.name}, {len(texts)} inputs")
    if figures:
        title = f"Kovaleva pattern types per layer ({VIEW_WORDS[view]}, {len(texts)} inputs)"
        pattern_shares_figure(shares, PATTERNS, title, out / "patterns.png")
        typer.echo(f"wrote {out / 'patterns.png'}", err=True)
