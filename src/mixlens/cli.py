"""The `mixlens` command line (typer + rich). Every user error is one line on stderr and exit code 2.

Subcommands live beside their feature; each module in `COMMAND_MODULES` exposes
`register(app: typer.Typer) -> None`.
"""

from __future__ import annotations

import importlib
import json
import sys
from enum import Enum
from pathlib import Path

import typer
from typer._click import exceptions as tx  # typer vendors click

from mixlens.errors import MixlensError, ReconstructionError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Show how a Transformer mixes information between tokens.")

COMMAND_MODULES: list[str] = ["mixlens.commands.corpus", "mixlens.commands.report", "mixlens.commands.heads",
                                 "mixlens.commands.gradients", "mixlens.commands.explain"]


class Format(str, Enum):
    table = "table"
    json = "json"
    html = "html"


def parse_options(items: list[str] | None) -> dict[str, dict[str, object]]:
    """`--option METHOD.KEY=VALUE` (VALUE as JSON, else a string) → {method: {key: value}}."""
    out: dict[str, dict[str, object]] = {}
    for item in items or []:
        name, eq, raw = item.partition("=")
        method, dot, key = name.partition(".")
        if not (eq and dot and method and key):
            raise MixlensError(f"bad --option '{item}'; expected METHOD.KEY=VALUE, e.g. globenc_rollout.normalize=true")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(method, {})[key] = value
    return out


def fail(message: str) -> None:
    """Raise a user error (one line, exit code 2)."""
    raise MixlensError(message)


def model_option() -> typer.models.OptionInfo:
    return typer.Option(None, "--model", "-m", help="Local HF model directory or hub id (default: bundled "
                        "all-MiniLM-L6-v2).")


@app.command()
def analyze(
    text: list[str] = typer.Argument(..., help="One or more texts to analyse."),
    model: str | None = model_option(),
    method: list[str] = typer.Option(None, "--method", help="Method name (repeatable); default: attention, "
                                     "norm, norm_res, norm_resln. `mixlens methods` lists them all."),
    heads: bool = typer.Option(False, "--heads", help="Per-head matrices for methods that have them."),
    fmt: Format = typer.Option(Format.table, "--format", "-f", help="table: print mixing ratios and write "
                               "JSON to --out; json: print the JSON to stdout (or --out); html: write a "
                               "self-contained report to --out (default mixlens-report.html)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Where to write the JSON "
                                    "(default for --format table: mixlens-analysis.json)."),
    max_length: int | None = typer.Option(None, "--max-length", min=1, help="Token limit (default: the "
                                          "model's)."),
    no_truncate: bool = typer.Option(False, "--no-truncate", help="Refuse over-long inputs instead of "
                                     "truncating them."),
    option: list[str] = typer.Option(None, "--option", help="Method option METHOD.KEY=VALUE (repeatable); "
                                     "`mixlens methods` lists each method's options."),
    head: str | None = typer.Option(None, "--head", help="Model head to load: base, masked-lm, "
                                    "sequence-classification, causal-lm (default: from the model config)."),
) -> None:
    """Decompose the attention blocks of TEXT and report the context-mixing ratio per layer."""
    from mixlens.lens import DEFAULT_METHODS, load
    from mixlens.methods import get

    methods = list(method) if method else list(DEFAULT_METHODS)
    for m in methods:
        get(m)  # unknown names fail before the model loads
    opts = parse_options(option)
    lens = load(model, head=head)
    res = lens.analyze(text, methods, heads=heads, max_length=max_length, truncate=not no_truncate,
                       options=opts)
    if fmt is Format.html:
        from mixlens.viz.html import render_report

        dest = out or Path("mixlens-report.html")
        from mixlens.result import atomic_write

        atomic_write(dest, render_report(res).encode())
        typer.echo(f"wrote report to {dest}", err=True)
        return
    payload = json.dumps(res.to_json())
    if fmt is Format.json and out is None:
        sys.stdout.write(payload + "\n")
        return
    dest = out or Path("mixlens-analysis.json")
    from mixlens.result import atomic_write

    atomic_write(dest, payload.encode())
    if fmt is Format.table:
        _print_ratios(res)
    typer.echo(f"wrote {', '.join(methods)} matrices for {len(text)} input(s) to {dest}", err=True)


def _print_ratios(res) -> None:
    from rich.console import Console
    from rich.table import Table

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


@app.command("methods")
def list_methods() -> None:
    """List the registered methods with their axes and options."""
    from mixlens.methods import REGISTRY

    for m in REGISTRY.values():
        extra = f" options: {m.options()}" if m.options() else ""
        print(f"{m.name:24s} [batch, {', '.join(m.dims)}]  {m.summary}{extra}")


for _mod in COMMAND_MODULES:
    importlib.import_module(_mod).register(app)


def _quiet_libraries() -> None:
    """Library chatter (hub retries, progress bars) would bury our one-line messages."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("huggingface_hub").setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning user errors into one line and exit code 2."""
    cmd = typer.main.get_command(app)
    _quiet_libraries()
    try:
        rc = cmd.main(args=argv, prog_name="mixlens", standalone_mode=False)
    except typer.Exit as e:
        rc = e.exit_code
    except typer.Abort:
        print("mixlens: aborted", file=sys.stderr)
        rc = 130
    except tx.ClickException as e:
        print(f"mixlens: error: {e.format_message()}", file=sys.stderr)
        rc = 2
    except (MixlensError, ReconstructionError) as e:
        print(f"mixlens: error: {e}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        print("mixlens: interrupted", file=sys.stderr)
        rc = 130
    sys.exit(rc if isinstance(rc, int) else 0)
