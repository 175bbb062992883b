"""`mixlens syntax`: dependency-head accuracy of every head against UD trees (docs/guides/bertology.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from mixlens.commands.options import (
    NO_RUNTIME,
    Runtime,
    batch_size_option,
    check_limit,
    check_view,
    data_option,
    gguf_file_option,
    limit_option,
    model_option,
    out_dir_option,
    runtime_options,
    table_format_option,
    view_option,
)
from mixlens.commands.output import TableFormat, progress, write_table


def register(app: typer.Typer) -> None:
    app.command("syntax")(runtime_options(syntax))


def syntax(
    data: str = data_option("CoNLL-U file (e.g. UD English EWT dev)."),
    model: str | None = model_option(),
    gguf_file: str | None = gguf_file_option(),
    limit: int | None = limit_option("Use only the first N sentences."),
    batch_size: int = batch_size_option(),
    view: str = view_option(),
    min_count: int = typer.Option(20, "--min-count", help="Report relations with at least this many arcs."),
    fmt: TableFormat = table_format_option("Format of the best-head table (csv/json to stdout)."),
    out: Path = out_dir_option("mixlens-syntax", "Directory for tables."),
    runtime: Runtime = NO_RUNTIME,
) -> None:
    """Dependency-head accuracy of every head per relation (both directions) with offset baselines."""
    from mixlens.result import atomic_write
    from mixlens.stats.syntax import read_conllu, syntax_heads
    from mixlens.viz.terminal import print_frame

    check_view(view)
    sents = list(read_conllu(data, check_limit(limit)))
    lens = runtime.load(model, gguf_file=gguf_file)
    with progress(len(sents), "syntax") as step:
        rep = syntax_heads(lens, sents, view=view, batch_size=batch_size, on_batch=step)
    best = rep.best(min_count)
    atomic_write(out / "syntax_scores.csv", rep.scores.to_csv(index=False).encode())
    typer.echo(f"wrote {out / 'syntax_scores.csv'}", err=True)
    write_table(best, fmt, out, "syntax_best")
    if fmt is TableFormat.table:
        print_frame(best, f"Best head per relation ({view}) — {lens.name}, {len(sents)} sentences")
