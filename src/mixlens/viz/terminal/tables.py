"""Plain result tables on the terminal (rich): right-aligned, split by columns to fit the terminal width."""

from __future__ import annotations

from typing import Any


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
