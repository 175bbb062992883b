"""Output shared by the commands: progress bars, stdout, writable-path checks and dataset tables as files (rich
and pandas load only when used); terminal tables are `mixlens.viz.terminal`."""

from __future__ import annotations

import sys
import time
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


PLAIN_EVERY = 60.0  # seconds between the plain progress lines of a job whose stderr is not a terminal


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def plain_progress(
    total: int | None,
    what: str,
    every: float = PLAIN_EVERY,
    clock: Callable[[], float] = time.monotonic,
    done: float = 0.0,
) -> Callable[[float], None]:
    """`advance(n)` for a log file: one line on stderr at most every `every` seconds (none for a job shorter than
    that), e.g. `evaluate: 120/1131 (10.6 %), 0:10:02 elapsed, about 1:24:31 left`. `done`: items finished before
    this run (a resumed one); the time left is estimated from this run's own pace."""
    start = last = clock()
    before = done

    def advance(n: float) -> None:
        nonlocal done, last
        done += n
        now = clock()
        if now - last < every:
            return
        last = now
        spent = now - start
        if total:
            left = spent * (total - done) / (done - before) if done > before else float("nan")
            rest = f", about {_clock(left)} left" if left == left else ""
            line = f"{what}: {int(done)}/{total} ({100 * done / total:.1f} %), {_clock(spent)} elapsed{rest}"
        else:
            line = f"{what}: {int(done)} done, {_clock(spent)} elapsed"
        print(line, file=sys.stderr, flush=True)

    return advance


@contextmanager
def progress(total: int | None, what: str, done: float = 0.0) -> Iterator[Callable[[float], None]]:
    """A rich progress bar on stderr, only when stderr is a terminal (never into piped or JSON output); yields
    `advance(n)` (n may be a fraction of an item: long items advance as their parts finish). The bar shows a
    spinner, items done of the total, the elapsed time and an estimate of the time left. `total=None`: a spinner
    with the elapsed time, for work whose size is not known in advance. When stderr is a file or pipe (a job under
    nohup or a scheduler) a plain line (`plain_progress`) every `PLAIN_EVERY` seconds instead. `done`: items
    finished by an earlier run that this one resumes (shown as done, not counted in the pace)."""
    if not sys.stderr.isatty():
        yield plain_progress(total, what, done=done)
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
        task = bar.add_task(what, total=total, completed=int(done))
        yield lambda n: bar.advance(task, n)


@contextmanager
def layer_progress(enabled: bool = True) -> Iterator[Callable[[str, int, int], None] | None]:
    """A rich bar of layers on stderr for one long input (`Lens.analyze(on_layer=...)`): the phase (the forward
    pass, then each rollout's row propagation), layers done of the total, elapsed time and an estimate of the time
    left. Yields None (no bar) when not `enabled` or stderr is not a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("layers"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("forward pass", total=None)

        def update(phase: str, done: int, total: int) -> None:
            if bar.tasks[0].description != phase:
                bar.reset(task, description=phase, total=total)
            bar.update(task, completed=done, total=total)

        yield update


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
    file where a directory is), a device, FIFO or socket (writing would replace it), a parent that is a file, or a
    nearest existing folder the user may not write to. The commands' `--out` options call it as they are read."""
    import os

    from mixlens.errors import MixlensError

    path = Path(path)
    if path.exists():
        if directory and not path.is_dir():
            raise MixlensError(f"cannot write to '{path}': it exists and is not a directory")
        if not directory and path.is_dir():
            raise MixlensError(f"cannot write '{path}': it is a directory; give a file name")
        if not directory and not path.is_file():
            raise MixlensError(f"cannot write '{path}': it is not a regular file (a device, FIFO or socket)")
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
