"""`mixlens corpus`: run methods over a dataset into resumable Parquet shards, an aggregate table and a manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from mixlens.commands.options import parse_options


def register(app: typer.Typer) -> None:
    @app.command("corpus")
    def corpus(
        data: str = typer.Option(
            ...,
            "--data",
            "-d",
            help="TSV/CSV/JSONL/Parquet/text file, or "
            "hf:NAME[:CONFIG]:SPLIT for a Hugging Face dataset (needs `datasets`).",
        ),
        out: Path = typer.Option(
            ...,
            "--out",
            "-o",
            help="Output directory (shards/, aggregate.parquet, manifest.json). Rerunning the same command resumes it.",
        ),
        model: str | None = typer.Option(
            None, "--model", "-m", help="Local HF model directory or hub id (default: bundled all-MiniLM-L6-v2)."
        ),
        method: list[str] = typer.Option(
            None, "--method", help="Method name (repeatable); default: attention, norm, norm_res, norm_resln."
        ),
        text_column: str | None = typer.Option(
            None, "--text-column", help="Column with the text (default: sentence/text/..., or the only column)."
        ),
        pair_column: str | None = typer.Option(
            None,
            "--pair-column",
            help="Column with the second text of a sentence pair (sentence1/sentence2 are paired by default).",
        ),
        fmt: str | None = typer.Option(
            None, "--format", help="tsv, csv, jsonl, parquet or text (default: from the file suffix)."
        ),
        store: str = typer.Option(
            "summary",
            "--store",
            help="summary: per-layer statistics per example; full: also the tokens and every requested matrix.",
        ),
        heads: bool = typer.Option(False, "--heads", help="Per-head matrices and per-(layer, head) statistics."),
        option: list[str] = typer.Option(None, "--option", help="Method option METHOD.KEY=VALUE (repeatable)."),
        batch_size: int = typer.Option(32, "--batch-size", help="Most examples per forward pass."),
        max_tokens: int = typer.Option(8192, "--max-tokens", help="Most padded tokens per forward pass."),
        max_length: int | None = typer.Option(
            None,
            "--max-length",
            help="Token limit per example (default: the model's); longer rows are truncated and counted.",
        ),
        shard_size: int = typer.Option(
            256, "--shard-size", help="Examples per shard (also the length-sorting window and the unit of resumption)."
        ),
        strict: bool = typer.Option(
            False, "--strict", help="Fail on the first bad record instead of skipping and counting it."
        ),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a different run already in --out."),
        backend: str = typer.Option("local", "--backend", help="local (in-process, or --workers processes) or ray."),
        address: str | None = typer.Option(None, "--address", help="Ray cluster address (default: start a local one)."),
        workers: int | None = typer.Option(
            None,
            "--workers",
            help="Local worker processes, or Ray actors (default: 1 local; one per cluster CPU on Ray).",
        ),
        head: str | None = typer.Option(
            None, "--head", help="Model head to load: base, masked-lm, sequence-classification, causal-lm."
        ),
        device: str = typer.Option("cpu", "--device", help="torch device for the model (e.g. cuda)."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary table."),
    ) -> None:
        """Run methods over every example of a dataset; resumable, sharded, in-process or on Ray."""
        from mixlens.corpus.runner import run_corpus

        res = run_corpus(
            data,
            out,
            list(method) if method else None,
            model=model,
            text_column=text_column,
            pair_column=pair_column,
            fmt=fmt,
            heads=heads,
            options=parse_options(option),
            store=store,
            batch_size=batch_size,
            max_tokens=max_tokens,
            max_length=max_length,
            shard_size=shard_size,
            strict=strict,
            overwrite=overwrite,
            backend=backend,
            workers=workers,
            address=address,
            head=head,
            device=device,
            progress=not quiet,
        )
        c = res.manifest["counts"]
        if not quiet:
            print_summary(res)
        skipped = ", ".join(f"{c[k]} {k}" for k in ("undecodable", "malformed", "empty") if c.get(k))
        typer.echo(
            f"{c['examples']} examples in {len(res.manifest['shards'])} shards → {out}"
            f" ({res.manifest['resumed_shards']} shards resumed)"
            + (f"; skipped: {skipped}" if skipped else "")
            + (f"; {c['truncated']} truncated to the token limit" if c["truncated"] else ""),
            err=True,
        )


def print_summary(res: Any) -> None:
    """The mean mixing ratio per layer and method of a corpus run, as a rich table on stderr."""
    from rich.console import Console
    from rich.table import Table

    agg = res.aggregate()
    r = agg[agg["stat"] == "mixing_ratio"].pivot(index="layer", columns="method", values="mean")
    table = Table(title=f"Mean context-mixing ratio (%) over all tokens — {res.manifest['model']}")
    table.add_column("layer", justify="right")
    for v in r.columns:
        table.add_column(str(v), justify="right")
    for layer, row in r.iterrows():
        table.add_row(str(layer), *(f"{100 * x:.1f}" for x in row))
    Console(stderr=True).print(table)
