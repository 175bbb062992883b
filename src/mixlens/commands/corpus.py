"""`mixlens corpus`: run methods over a dataset into resumable Parquet shards, an aggregate table and a manifest."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from mixlens.commands.options import (
    allow_random_head_option,
    data_option,
    deprecated_head_option,
    device_option,
    dtype_option,
    gguf_file_option,
    max_length_option,
    method_list_option,
    method_options_option,
    model_head_option,
    model_option,
    pair_column_option,
    parse_options,
    pick_model_head,
    text_column_option,
    writable_dir,
)


def _out_dir(value: str | None) -> str | None:
    """`--out`: a local directory is checked as every command's `--out` is; a URI is checked when the run opens it."""
    if value is not None and "://" not in value:
        writable_dir(Path(value))
    return value


def register(app: typer.Typer) -> None:
    @app.command("corpus")
    def corpus(
        data: str = data_option(
            "TSV/CSV/JSONL/Parquet/text file, or hf:NAME[:CONFIG]:SPLIT for a Hugging Face dataset (needs `datasets`)."
        ),
        out: str = typer.Option(
            ...,
            "--out",
            "-o",
            help="Output directory (shards/, aggregate.parquet, manifest.json), a local path or a filesystem URI "
            "(file://, s3://, gs://, ...). Rerunning the same command resumes it.",
            callback=_out_dir,
        ),
        model: str | None = model_option(),
        gguf_file: str | None = gguf_file_option(),
        method: list[str] = method_list_option(),
        text_column: str | None = text_column_option(
            "Column with the text (default: sentence/text/..., or the only column)."
        ),
        pair_column: str | None = pair_column_option(
            "Column with the second text of a sentence pair (sentence1/sentence2 are paired by default)."
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
        option: list[str] = method_options_option(),
        batch_size: int = typer.Option(32, "--batch-size", help="Most examples per forward pass."),
        max_tokens: int = typer.Option(8192, "--max-tokens", help="Most padded tokens per forward pass."),
        max_length: int | None = max_length_option(),
        shard_size: int = typer.Option(
            256, "--shard-size", help="Examples per shard (also the length-sorting window and the unit of resumption)."
        ),
        strict: bool = typer.Option(
            False, "--strict", help="Fail on the first bad record instead of skipping and counting it."
        ),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a different run already in --out."),
        backend: str = typer.Option(
            "local",
            "--backend",
            help="local (in-process, or --workers processes), ray (actors fed by this process) or ray-data "
            "(the cluster reads, computes and writes; input may be a Parquet folder or a URI such as s3://).",
        ),
        address: str | None = typer.Option(None, "--address", help="Ray cluster address (default: start a local one)."),
        workers: int | None = typer.Option(
            None,
            "--workers",
            "--concurrency",
            help="Local worker processes, or Ray actors (default: 1 local; one per cluster CPU, or GPU, on Ray).",
        ),
        num_cpus: float | None = typer.Option(
            None, "--num-cpus", help="ray-data: CPUs per actor (default 1, 0 with a GPU); also its torch threads."
        ),
        num_gpus: float | None = typer.Option(
            None, "--num-gpus", help="ray-data: GPUs per actor (default 1 with --device cuda, else 0)."
        ),
        tokenize_cpus: float | None = typer.Option(
            None,
            "--tokenize-cpus",
            help="ray-data: tokenise in a stage of CPU tasks of T CPUs each, not in the actors (default: a stage of "
            "0-CPU tasks with GPU actors, none with CPU actors); give CPUs when the actors leave some free.",
        ),
        model_head: str | None = model_head_option(),
        head: str | None = deprecated_head_option(),
        allow_random_head: bool = allow_random_head_option(),
        dtype: str | None = dtype_option(),
        device: str | None = device_option(),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary table."),
    ) -> None:
        """Run methods over every example of a dataset; resumable, sharded, in-process or on Ray."""
        from mixlens.corpus.readers import HF_PREFIX, iter_examples
        from mixlens.corpus.runner import run_corpus
        from mixlens.lens import dtype_name, resolve_device

        device = resolve_device(device or "cpu")  # a CUDA device this machine lacks: one line, before any work
        dtype = dtype_name(dtype or "float32")

        if backend != "ray-data" and not data.startswith(HF_PREFIX):  # no usable row: fails before model and --out
            next(iter_examples(data, text_column, pair_column, strict, fmt=fmt))
        try:
            res = run_corpus(
                data,
                out,
                list(method) if method else None,
                model=model,
                gguf_file=gguf_file,
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
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                tokenize_cpus=tokenize_cpus,
                head=pick_model_head(model_head, head),
                device=device,
                dtype=dtype,
                progress=not quiet and sys.stderr.isatty(),  # progress only on a terminal
                allow_random_head=allow_random_head,
            )
        except KeyboardInterrupt:
            from mixlens.commands.options import interrupted

            raise interrupted(f"finished shards in {out} are kept") from None
        c = res.manifest["counts"]
        if not quiet:
            from mixlens.viz.terminal import print_corpus_summary

            print_corpus_summary(res)
        skipped = ", ".join(f"{c[k]} {k}" for k in ("undecodable", "malformed", "empty") if c.get(k))
        typer.echo(
            f"{c['examples']} examples in {len(res.manifest['shards'])} shards → {out}"
            f" ({res.manifest['resumed_shards']} shards resumed)"
            + (f"; skipped: {skipped}" if skipped else "")
            + (f"; {c['truncated']} truncated to the token limit" if c["truncated"] else ""),
            err=True,
        )
        if res.manifest.get("ray", {}).get("logs"):
            r = res.manifest["ray"]
            nodes = ", ".join(f"{k}: {v}" for k, v in r.get("nodes", {}).items())
            typer.echo(
                f"Ray Data: {r['actors']} actors on {r['address']}"
                + (f"; examples computed per node: {nodes}" if nodes else "")
                + f"; Ray logs: {r['logs']}",
                err=True,
            )
