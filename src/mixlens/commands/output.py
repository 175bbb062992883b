"""Table output and progress shared by the dataset commands (rich and pandas load only when used)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any

import typer


class TableFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


@contextmanager
def progress(total: int, what: str) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr; yields `advance(n)`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


def write_table(df: Any, fmt: TableFormat, out_dir: Path, stem: str) -> None:
    """A pandas DataFrame: csv/json to stdout; parquet/table to `out_dir/stem.parquet` (and a CSV beside it)."""
    from mixlens.result import atomic_write

    if fmt is TableFormat.csv:
        sys.stdout.write(df.to_csv(index=False))
    elif fmt is TableFormat.json:
        sys.stdout.write(df.to_json(orient="records", force_ascii=False) + "\n")
    else:
        import io

        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
        atomic_write(out_dir / f"{stem}.parquet", buf.getvalue())
        atomic_write(out_dir / f"{stem}.csv", df.to_csv(index=False).encode())
        typer.echo(f"wrote {out_dir / stem}.parquet and .csv", err=True)


def print_frame(df: Any, title: str) -> None:
    """A pandas DataFrame as a rich table on stderr (floats to 3 decimals)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in df.columns:
        table.add_column(str(c), justify="right")
    for row in df.itertuples(index=False):
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
    Console(stderr=True).print(table)
