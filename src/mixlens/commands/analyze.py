"""`mixlens analyze` (decompose texts, print mixing ratios, write JSON or HTML) and `mixlens methods`."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import typer

from mixlens.commands.options import check_methods, model_option, parse_options


class Format(str, Enum):
    table = "table"
    json = "json"
    html = "html"


def register(app: typer.Typer) -> None:
    app.command("analyze")(analyze)
    app.command("methods")(list_methods)


def analyze(
    text: list[str] = typer.Argument(..., help="One or more texts to analyse."),
    model: str | None = model_option(),
    method: list[str] = typer.Option(
        None,
        "--method",
        help="Method name (repeatable); default: attention, "
        "norm, norm_res, norm_resln. `mixlens methods` lists them all.",
    ),
    heads: bool = typer.Option(False, "--heads", help="Per-head matrices for methods that have them."),
    fmt: Format = typer.Option(
        Format.table,
        "--format",
        "-f",
        help="table: print mixing ratios and write "
        "JSON to --out; json: print the JSON to stdout (or --out); html: write a "
        "self-contained report to --out (default mixlens-report.html).",
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Where to write the JSON (default for --format table: mixlens-analysis.json)."
    ),
    max_length: int | None = typer.Option(None, "--max-length", min=1, help="Token limit (default: the model's)."),
    no_truncate: bool = typer.Option(
        False, "--no-truncate", help="Refuse over-long inputs instead of truncating them."
    ),
    option: list[str] = typer.Option(
        None,
        "--option",
        help="Method option METHOD.KEY=VALUE (repeatable); `mixlens methods` lists each method's options.",
    ),
    head: str | None = typer.Option(
        None,
        "--head",
        help="Model head to load: base, masked-lm, "
        "sequence-classification, causal-lm (default: from the model config).",
    ),
    targets: str | None = typer.Option(
        None,
        "--targets",
        help="Target rows to compute: last, all, or positions i,j,... (negative: from the end). Default: last for "
        "causal LMs over 512 tokens, else all.",
    ),
) -> None:
    """Decompose the attention blocks of TEXT and report the context-mixing ratio per layer."""
    from mixlens.lens import load
    from mixlens.result import atomic_write

    methods = check_methods(method)
    opts = parse_options(option)
    rows = parse_targets(targets)
    lens = load(model, head=head)
    if rows is None:
        long = max(len(t) for t in lens.encode(text, max_length=max_length, truncate=not no_truncate).tokens)
        rows = "last" if lens.adapter.family.causal and long > LONG_CAUSAL else "all"
    if fmt is Format.html and rows != "all":
        from mixlens.errors import MixlensError

        raise MixlensError("the HTML report shows full maps: use --targets all (or --format json for target rows)")
    res = lens.analyze(text, methods, heads=heads, max_length=max_length, truncate=not no_truncate, options=opts,
                       targets=rows)
    if fmt is Format.html:
        from mixlens.viz.html import render_report

        dest = out or Path("mixlens-report.html")
        atomic_write(dest, render_report(res).encode())
        typer.echo(f"wrote report to {dest}", err=True)
        return
    payload = json.dumps(res.to_json())
    if fmt is Format.json and out is None:
        sys.stdout.write(payload + "\n")
        return
    dest = out or Path("mixlens-analysis.json")
    atomic_write(dest, payload.encode())
    if fmt is Format.table:
        print_ratios(res)
    typer.echo(f"wrote {', '.join(methods)} matrices for {len(text)} input(s) to {dest}", err=True)


LONG_CAUSAL = 512  # tokens above which a causal LM's default --targets is `last`


def parse_targets(given: str | None) -> str | list[int] | None:
    """--targets: None (decide from the model and input), 'last', 'all' or a list of integer positions."""
    from mixlens.errors import MixlensError

    if given is None or given.strip() in ("last", "all"):
        return None if given is None else given.strip()
    try:
        return [int(p) for p in given.split(",")]
    except ValueError:
        raise MixlensError(f"--targets must be last, all or comma-separated integer positions, got {given!r}") from None


def print_ratios(res: Any) -> None:
    """The mean mixing ratio per layer of each variant of an `Analysis`, as a rich table."""
    from rich.console import Console
    from rich.table import Table

    if not res.ratios:  # no requested method used the norm engine
        return
    means = {v: res.mixing_ratio(v).mean(0) for v in res.ratios}
    table = Table(title=f"Context-mixing ratio (%), mean over tokens and inputs — {res.model}")
    table.add_column("layer", justify="right")
    for v in means:
        table.add_column(v, justify="right")
    for layer in range(len(means["W"])):
        table.add_row(str(layer), *(f"{100 * means[v][layer]:.1f}" for v in means))
    table.add_row("mean", *(f"{100 * means[v].mean():.1f}" for v in means), style="bold")
    Console().print(table)
    print(f"reconstruction error (max abs): {res.reconstruction_error.max():.2e}")


def list_methods() -> None:
    """List the registered methods with their axes and options."""
    from mixlens.methods import REGISTRY

    for m in REGISTRY.values():
        extra = f" options: {m.options()}" if m.options() else ""
        print(f"{m.name:24s} [batch, {', '.join(m.dims)}]  {m.summary}{extra}")
