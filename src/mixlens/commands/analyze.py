"""`mixlens analyze` (decompose texts, print mixing ratios, write JSON or HTML) and `mixlens methods`."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import typer

from mixlens.commands.options import (
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
)
from mixlens.commands.output import check_writable, method_progress, write_stdout
from mixlens.errors import MixlensError


class Format(str, Enum):
    table = "table"
    json = "json"
    html = "html"


def register(app: typer.Typer) -> None:
    app.command("analyze")(runtime_options(analyze))
    app.command("methods")(list_methods)


NORM_FAMILY = ("attention", "norm", "norm_res", "norm_resln")  # the methods the mixing-ratio table describes
TOP_SOURCES = 3  # sources listed per token for map methods


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
        None, "--out", "-o", help="Where to write the JSON (default for --format table: mixlens-analysis.json)."
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
    targets: str | None = typer.Option(
        None,
        "--targets",
        help="Target rows to compute: last, all, or positions i,j,... (negative: from the end). Default: last for "
        "causal LMs over 512 tokens, else all.",
    ),
) -> None:
    """Decompose TEXT with each method and print what it found (mixing ratios, top sources, token scores)."""
    from mixlens.lens import load
    from mixlens.result import atomic_write

    methods = check_methods(method)
    opts = parse_options(option)
    model_head = pick_model_head(model_head, head)
    dest = out or Path("mixlens-report.html" if fmt is Format.html else "mixlens-analysis.json")
    if fmt is not Format.json or out is not None:  # an unwritable --out is found before the work
        check_writable(dest)
    rows = parse_targets(targets)
    if fmt is Format.html and rows not in (None, "all"):
        raise MixlensError("the HTML report shows full maps: use --targets all (or --format json for target rows)")
    precheck_model(model, model_head, methods, text, max_length, gguf_file)
    lens = load(model, gguf_file=gguf_file, head=model_head, allow_random_head=allow_random_head)
    if rows is None:
        long = max(len(t) for t in lens.encode(text, max_length=max_length, truncate=not no_truncate).tokens)
        rows = "last" if lens.adapter.family.causal and long > LONG_CAUSAL else "all"
        if fmt is Format.html and rows != "all":
            raise MixlensError("the HTML report shows full maps: use --targets all (or --format json for target rows)")
    with method_progress(methods, len(text)) as step:
        res = lens.analyze(
            text,
            methods,
            heads=heads,
            max_length=max_length,
            truncate=not no_truncate,
            options=opts,
            on_batch=step,
            targets=rows,
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
        print_results(res, methods)
    atomic_write(dest, payload.encode())
    written = "; ".join(f"{m} ({describe(res[m])})" for m in methods)
    typer.echo(f"wrote {written} for {len(text)} input(s) to {dest}", err=True)


def describe(attr: Any) -> str:
    """What an `Attribution` holds, in words (for the 'wrote …' line)."""
    dims = attr.dims
    if dims[-2:] == ("target", "source"):
        per = [f"per {d}" for d in dims[:-2]]
        return " ".join(["token × token maps", *per])
    if dims[-1] == "source":
        return "a score per " + " and ".join([*dims[:-1], "token"])
    return "values over " + ", ".join(dims)


def print_results(res: Any, methods: list[str]) -> None:
    """Per requested method what a reader can use: the mixing-ratio table for the norm family, each token's top
    sources at the last layer for token × token maps, the tokens with their scores for per-token methods."""
    from rich.console import Console

    console = Console()
    if any(m in NORM_FAMILY for m in methods):
        print_ratios(res)
    for m in methods:
        attr = res[m]
        if attr.dims[-2:] == ("target", "source"):
            print_top_sources(attr)
        elif attr.dims[-1] == "source":
            print_scores(attr, console)
        else:
            console.print(f"{m}: {describe(attr)} (see the JSON)")


def _last_layer_map(attr: Any, b: int) -> tuple[Any, str]:
    """Input b's [target, source] map: last layer, mean over heads, index 0 of any other leading axis."""
    v = attr.input(b)
    where: list[str] = []
    for d in attr.dims[:-2]:
        if d == "layer":
            where.append(f"layer {v.shape[0] - 1}")
            v = v[-1]
        elif d == "head":
            where.append("mean over heads")
            v = v.mean(0)
        else:
            v = v[0]
    return v, ", ".join(where)


def print_top_sources(attr: Any) -> None:
    """For each token of each input (or each computed target row, with --targets), its strongest sources (by
    |value|) in the method's last-layer map."""
    import numpy as np

    from mixlens.commands.output import print_table
    from mixlens.methods.rollout import DISPLAY_NOTE, display_rows

    for b, toks in enumerate(attr.tokens):
        m, where = _last_layer_map(attr, b)
        m, scaled = display_rows(attr.method, m)
        targets = list(range(len(toks))) if attr.targets is None else attr.targets[b]
        rows = []
        for i, pos in enumerate(targets):  # row i of the map is token `pos`
            order = np.argsort(-np.abs(m[i]), kind="stable")[:TOP_SOURCES]
            label = toks[pos] if attr.targets is None else f"{pos}: {toks[pos]}"
            rows.append([label, "  ".join(f"{toks[j]} {m[i, j]:.2f}" for j in order)])
        what = f"{attr.method}: top {TOP_SOURCES} sources of " + (
            "each token"
            if attr.targets is None
            else f"target row{'s' if len(targets) > 1 else ''} {_positions(targets)}"
        )
        what += f" ({where})" if where else ""
        print_table(what + (f" — input {b + 1}" if len(attr.tokens) > 1 else ""), ["token", "sources"], rows, left=(1,))
        if scaled and b == len(attr.tokens) - 1:
            print(f"note: {attr.method}: {DISPLAY_NOTE}")


def _positions(targets: list[int]) -> str:
    return ", ".join(map(str, targets)) if len(targets) <= 8 else f"{', '.join(map(str, targets[:8]))}, …"


def print_scores(attr: Any, console: Any) -> None:
    """The tokens of each input with their scores; the strongest |score| tokens highlighted (red +, blue −)."""
    import numpy as np
    from rich.text import Text

    for b, toks in enumerate(attr.tokens):
        v = attr.input(b)  # [*lead, n]
        rows = v.reshape(-1, v.shape[-1])
        labels = [""] if v.ndim == 1 else [f"{attr.dims[0]} {k}: " for k in range(rows.shape[0])]
        console.print(f"{attr.method}" + (f" — input {b + 1}" if len(attr.tokens) > 1 else "") + ":")
        for label, r in zip(labels, rows, strict=True):
            top = set(np.argsort(-np.abs(r), kind="stable")[:TOP_SOURCES].tolist())
            line = Text("  " + label)
            for j, t in enumerate(toks):
                style = ("bold white on red" if r[j] >= 0 else "bold white on blue") if j in top else ""
                line.append(f"{t}", style=style)
                line.append(f" {r[j]:.3g}  ", style="dim")
            console.print(line)


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
    """The mean mixing ratio per layer of each variant of an `Analysis`, as a table that fits the terminal."""
    from mixlens.commands.output import print_table

    if not res.ratios:  # no requested method used the norm engine
        return
    means = {v: res.mixing_ratio(v).mean(0) for v in res.ratios}
    rows = [[str(layer), *(f"{100 * means[v][layer]:.1f}" for v in means)] for layer in range(len(means["W"]))]
    rows.append(["mean", *(f"{100 * means[v].mean():.1f}" for v in means)])
    print_table(f"Context-mixing ratio (%), mean over tokens and inputs — {res.model}", ["layer", *means], rows)
    print(f"reconstruction error (max abs): {res.reconstruction_error.max():.2e}")


def list_methods() -> None:
    """List every method: axes, what it reads and explains, the families it refuses, its options."""
    from mixlens.catalog import lines, load

    print("\n".join(lines(load())))
