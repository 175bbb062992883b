"""`mixlens patterns`: Kovaleva pattern types of the heads per layer over a dataset (docs/guides/bertology.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from mixlens.commands.options import (
    NO_RUNTIME,
    Dataset,
    Runtime,
    check_view,
    dataset_command,
    figures_option,
    out_dir_option,
    runtime_options,
    table_format_option,
    view_option,
)
from mixlens.commands.output import TableFormat, progress, write_table


def register(app: typer.Typer) -> None:
    app.command("patterns")(runtime_options(patterns))


@dataset_command
def patterns(
    ds: Dataset,
    view: str = view_option(),
    fmt: TableFormat = table_format_option(),
    out: Path = out_dir_option("mixlens-patterns", "Directory for table and figure."),
    figures: bool = figures_option("Also write the figure patterns.png to --out."),
    runtime: Runtime = NO_RUNTIME,
) -> None:
    """Share of each Kovaleva pattern type (vertical, diagonal, ...) per layer over a dataset."""
    import pandas as pd

    from mixlens.stats.patterns import PATTERNS, classify_inputs, pattern_shares
    from mixlens.viz.heads import VIEW_WORDS, pattern_shares_figure
    from mixlens.viz.terminal import print_frame

    check_view(view)
    texts = ds.texts()
    lens = ds.load(runtime)
    with progress(len(texts), "patterns") as step:
        labels = classify_inputs(lens, texts, view=view, batch_size=ds.batch_size, on_batch=step)
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
