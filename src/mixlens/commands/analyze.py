"""`mixlens analyze` (decompose texts, print mixing ratios, write JSON or HTML) and `mixlens methods`."""

from __future__ import annotations

import json
from contextlib import nullcontext
from enum import Enum
from pathlib import Path

import typer

from mixlens.commands.options import (
    NO_RUNTIME,
    Runtime,
    allow_random_head_option,
    check_methods,
    deprecated_head_option,
    gguf_file_option,
    max_length_option,
    method_list_option,
    method_options_option,
    model_head_option,
    model_option,
    parse_options,
    pick_model_head,
    precheck_model,
    runtime_options,
    writable_file,
)
from mixlens.commands.output import check_writable, layer_progress, method_progress, write_stdout
from mixlens.errors import MixlensError


class Format(str, Enum):
    table = "table"
    json = "json"
    html = "html"


def register(app: typer.Typer) -> None:
    app.command("analyze")(runtime_options(analyze))
    app.command("methods")(list_methods)


def analyze(
    text: list[str] = typer.Argument(..., help="One or more texts to analyse."),
    model: str | None = model_option(),
    gguf_file: str | None = gguf_file_option(),
    method: list[str] = method_list_option(
        "Method name (repeatable); default: attention, norm, norm_res, norm_resln. `mixlens methods` lists them all."
    ),
    heads: bool = typer.Option(False, "--heads", help="Per-head matrices for methods that have them."),
    fmt: Format = typer.Option(
        Format.table,
        "--format",
        "-f",
        help="table: print what each method found and write "
        "JSON to --out; json: print the JSON to stdout (or --out); html: write a "
        "self-contained report to --out (default mixlens-report.html).",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="Where to write the JSON (default for --format table: mixlens-analysis.json).",
        callback=writable_file,
    ),
    max_length: int | None = max_length_option(),
    no_truncate: bool = typer.Option(
        False, "--no-truncate", help="Refuse over-long inputs instead of truncating them."
    ),
    option: list[str] = method_options_option(
        "Method option METHOD.KEY=VALUE (repeatable); `mixlens methods` lists each method's options."
    ),
    model_head: str | None = model_head_option(),
    head: str | None = deprecated_head_option(),
    allow_random_head: bool = allow_random_head_option(),
    rows_given: str | None = typer.Option(
        None,
        "--rows",
        help="Rows of the [target, source] maps to compute: last, all, or positions i,j,... (negative: from the "
        "end). Default: last for causal LMs over 512 tokens, else all.",
    ),
    targets: str | None = typer.Option(None, "--targets", hidden=True, help="Deprecated name of --rows."),
    runtime: Runtime = NO_RUNTIME,
) -> None:
    """Decompose TEXT with each method and print what it found (mixing ratios, top sources, token scores)."""
    from mixlens.result import atomic_write
    from mixlens.viz.terminal import describe, print_results

    methods = check_methods(method)
    opts = parse_options(option)
    model_head = pick_model_head(model_head, head)
    dest = out or Path("mixlens-report.html" if fmt is Format.html else "mixlens-analysis.json")
    if fmt is not Format.json or out is not None:  # an unwritable --out is found before the work
        check_writable(dest)
    if targets is not None:
        if rows_given is not None:
            raise MixlensError("give --rows only (--targets is its deprecated name)")
        typer.echo("warning: --targets is deprecated, use --rows", err=True)
    rows = parse_rows(rows_given if targets is None else targets)
    if fmt is Format.html and rows not in (None, "all"):
        raise MixlensError("the HTML report shows full maps: use --rows all (or --format json for some rows)")
    precheck_model(model, model_head, methods, text, max_length, gguf_file)
    lens = runtime.load(model, gguf_file=gguf_file, head=model_head, allow_random_head=allow_random_head)
    if rows is None:  # the library's default (`Lens.auto_rows`), so the Python API and the CLI agree
        rows = lens.auto_rows(text, max_length=max_length, truncate=not no_truncate)
        if fmt is Format.html and rows != "all":
            raise MixlensError("the HTML report shows full maps: use --rows all (or --format json for some rows)")
    long_one = len(text) == 1 and rows != "all" and lens.adapter.family.causal  # one long input: a bar of layers
    per_input = nullcontext(lambda n: None) if long_one else method_progress(methods, len(text))
    with per_input as step, layer_progress(long_one) as on_layer:
        res = lens.analyze(
            text,
            methods,
            heads=heads,
            max_length=max_length,
            truncate=not no_truncate,
            options=opts,
            on_batch=step,
            rows=rows,
            on_layer=on_layer,
        )
    if fmt is Format.html:
        from mixlens.viz.html import render_report

        atomic_write(dest, render_report(res).encode())
        typer.echo(f"wrote report to {dest}", err=True)
        return
    payload = json.dumps(res.to_json())
    if fmt is Format.json and out is None:
        write_stdout(payload + "\n")
        return
    if fmt is Format.table:  # printed before the file is written: a failure here leaves nothing behind
        print_results(res, methods, str(lens.dtype).removeprefix("torch."))
    atomic_write(dest, payload.encode())
    written = "; ".join(f"{m} ({describe(res[m])})" for m in methods)
    typer.echo(f"wrote {written} for {len(text)} input(s) to {dest}", err=True)


def parse_rows(given: str | None) -> str | list[int] | None:
    """--rows: None (decide from the model and input), 'last', 'all' or a list of integer positions."""
    from mixlens.errors import MixlensError

    if given is None or given.strip() in ("last", "all"):
        return None if given is None else given.strip()
    try:
        return [int(p) for p in given.split(",")]
    except ValueError:
        raise MixlensError(f"--rows must be last, all or comma-separated integer positions, got {given!r}") from None


def list_methods() -> None:
    """List every method: axes, what it reads and explains, the families it refuses, its options."""
    from mixlens.catalog import lines, load

    print("\n".join(lines(load())))
