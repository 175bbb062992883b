"""Table output and progress shared by the dataset commands (rich and pandas load only when used)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
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
def progress(total: int | None, what: str) -> Iterator[Callable[[float], None]]:
    """A rich progress bar on stderr, only when stderr is a terminal (never into piped or JSON output); yields
    `advance(n)` (n may be a fraction of an item: long items advance as their parts finish). The bar shows a
    spinner, items done of the total, the elapsed time and an estimate of the time left. `total=None`: a spinner
    with the elapsed time, for work whose size is not known in advance."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        [SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()]
        if total is None
        else [
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
        ]
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


def method_progress(methods: list[str], n_inputs: int) -> AbstractContextManager[Callable[[float], None]]:
    """`progress` over the inputs when a slow method is requested (a spinner for one input), else a no-op;
    yields `advance(n)` for `Lens.analyze(on_batch=...)`."""
    from mixlens.methods import get

    slow = [m for m in methods if get(m).extra_passes or get(m).slow]
    if not slow:
        return nullcontext(lambda n: None)
    return progress(None if n_inputs <= 1 else n_inputs, f"{', '.join(slow)}")


def write_stdout(text: str) -> None:
    """Write `text` to stdout and flush it: a full disk or a closed pipe behind stdout is a `MixlensError` (one line,
    exit 2) instead of a lost result with exit 0."""
    from mixlens.errors import MixlensError

    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as e:
        raise MixlensError(f"cannot write to stdout: {e.strerror or e}") from None


def check_writable(path: Path, *, directory: bool = False) -> None:
    """Refuse, before any work, an output `path` that cannot be written: a directory where a file is wanted (or a
    file where a directory is), a parent that is a file, or a nearest existing folder the user may not write to."""
    import os

    from mixlens.errors import MixlensError

    path = Path(path)
    if path.exists():
        if directory and not path.is_dir():
            raise MixlensError(f"cannot write to '{path}': it exists and is not a directory")
        if not directory and path.is_dir():
            raise MixlensError(f"cannot write '{path}': it is a directory; give a file name")
    folder = path if directory else path.parent
    while not folder.exists():
        if folder.is_symlink():  # a dangling link: creating the folder fails
            raise MixlensError(f"cannot write '{path}': '{folder}' is a broken link")
        if folder.parent == folder:
            break
        folder = folder.parent
    if folder.exists() and not folder.is_dir():
        raise MixlensError(f"cannot write '{path}': '{folder}' is not a directory")
    if folder.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise MixlensError(f"cannot write '{path}': no permission to write in '{folder}'")


def write_table(df: Any, fmt: TableFormat, out_dir: Path, stem: str) -> None:
    """A pandas DataFrame: csv/json to stdout; parquet/table to `out_dir/stem.parquet` (and a CSV beside it)."""
    from mixlens.result import atomic_write

    if fmt is TableFormat.csv:
        write_stdout(df.to_csv(index=False))
    elif fmt is TableFormat.json:
        write_stdout(df.to_json(orient="records", force_ascii=False) + "\n")
    else:
        import io

        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
        atomic_write(out_dir / f"{stem}.parquet", buf.getvalue())
        atomic_write(out_dir / f"{stem}.csv", df.to_csv(index=False).encode())
        typer.echo(f"wrote {out_dir / stem}.parquet and .csv", err=True)


def print_frame(df: Any, title: str) -> None:
    """A pandas DataFrame as rich tables on stderr (floats to 3 decimals), split by columns to fit the terminal."""
    rows = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in df.itertuples(index=False)]
    print_table(title, [str(c) for c in df.columns], rows, stderr=True)


def print_table(
    title: str, columns: list[str], rows: list[list[str]], *, stderr: bool = False, left: tuple[int, ...] = ()
) -> None:
    """Right-aligned rich tables that fit the terminal width: when the columns do not fit, they are split over
    several tables, each repeating the first (key) column; headers are never cut. Columns in `left` align left."""
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=stderr)
    widths = [max([len(c), *(len(r[k]) for r in rows)]) + 3 for k, c in enumerate(columns)]  # + padding, border
    groups: list[list[int]] = [[]]
    used = widths[0] + 1
    for k in range(1, len(columns)):
        if groups[-1] and used + widths[k] > console.width:
            groups.append([])
            used = widths[0] + 1
        groups[-1].append(k)
        used += widths[k]
    for g, group in enumerate(groups):
        part = f" ({g + 1}/{len(groups)})" if len(groups) > 1 else ""
        table = Table(title=title + part)
        for k in [0, *group]:
            table.add_column(columns[k], justify="left" if k in left else "right", no_wrap=k not in left)
        for r in rows:
            table.add_row(*(r[k] for k in [0, *group]))
        console.print(table)
