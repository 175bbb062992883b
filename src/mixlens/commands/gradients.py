"""CLI: `mixlens compare-local-global` (attention vs head attribution over a dataset file) and `mixlens saliency`."""

from __future__ import annotations

from pathlib import Path

import typer

from mixlens import catalog
from mixlens.commands.options import (
    NO_RUNTIME,
    Runtime,
    allow_random_head_option,
    batch_size_option,
    deprecated_head_option,
    gguf_file_option,
    max_length_option,
    model_head_option,
    model_option,
    pair_column_option,
    pick_model_head,
    read_examples,
    runtime_options,
    text_column_option,
    writable_file,
)
from mixlens.commands.output import progress
from mixlens.errors import MixlensError


def register(app: typer.Typer) -> None:
    @app.command("compare-local-global")
    @runtime_options
    def compare_local_global_cmd(
        data: Path = typer.Argument(..., help="Dataset file (TSV/CSV/JSONL/Parquet/text), one input per record."),
        model: str | None = model_option(),
        gguf_file: str | None = gguf_file_option(),
        text_column: str | None = text_column_option("Column with the text."),
        pair_column: str | None = pair_column_option("Column with the second text of a pair."),
        limit: int = typer.Option(64, "--limit", min=0, help="Use the first N records (0 = all)."),
        mode: str = typer.Option("estimate", "--mode", help="exact (n·d JVPs per input) or estimate (Hutchinson)."),
        probes: int = typer.Option(16, "--probes", help="Random probes per source token in estimate mode."),
        input: str = typer.Option(
            "word",
            "--input",
            help="Differentiate w.r.t. 'word' (word-piece) embeddings or the 'embedding'-layer output.",
        ),
        batch_size: int = batch_size_option(8, None),
        max_length: int | None = max_length_option(),
        out: Path = typer.Option(
            Path("local-global.json"), "--out", "-o", help="JSON with all per-head numbers.", callback=writable_file
        ),
        figure: Path | None = typer.Option(None, "--figure", help="Also write a PNG/SVG figure here."),
        runtime: Runtime = NO_RUNTIME,
    ) -> None:
        """Compare what each head attends to (attention) with which inputs its output depends on (gradients)."""
        from mixlens.methods.gradients import MODES
        from mixlens.result import atomic_write
        from mixlens.stats.agreement import compare_local_global
        from mixlens.viz.heads import local_global_figure

        if mode not in MODES:
            raise MixlensError(f"unknown mode '{mode}'; valid: {', '.join(MODES)}")
        from mixlens.commands.explain import data_file

        data_file(data)  # a directory is named as one
        for path in (out, figure):
            if path is not None and path.is_dir():
                raise MixlensError(f"cannot write '{path}': it is a directory; give a file name")
        texts = [ex.text for ex in read_examples(str(data), text_column, pair_column, limit or None)]
        lens = runtime.load(model, gguf_file=gguf_file)
        with progress(len(texts), f"compare-local-global ({mode})") as step:
            res = compare_local_global(
                lens,
                texts,
                batch_size=batch_size,
                max_length=max_length,
                input=input,
                mode=mode,
                probes=probes,
                on_batch=step,
            )
        atomic_write(out, res.dumps().encode())
        if figure:
            local_global_figure(res, figure)
        from mixlens.viz.terminal import print_agreement

        print_agreement(res)
        typer.echo(f"wrote {out}" + (f" and {figure}" if figure else ""), err=True)

    @app.command("saliency")
    @runtime_options
    def saliency_cmd(
        text: list[str] = typer.Argument(..., help="One or more texts."),
        model: str | None = model_option(),
        gguf_file: str | None = gguf_file_option(),
        model_head: str | None = model_head_option(),
        head: str | None = deprecated_head_option(),
        allow_random_head: bool = allow_random_head_option(),
        kind: str = typer.Option(
            catalog.defaults("saliency")[0], "--kind", help="saliency, grad_x_input or integrated_gradients."
        ),
        target: str = typer.Option(
            "pred", "--target", help="'pred' (predicted class/token) or a class index / token id."
        ),
        position: int | None = typer.Option(
            None,
            "--position",
            help="Token position of an LM target (default: the [MASK], or the last token for causal LMs).",
        ),
        reduction: str = typer.Option("l2", "--reduction", help="l2, l1 or sum over hidden dims."),
        steps: int = typer.Option(50, "--steps", help="Integrated-gradients steps."),
        baseline: str = typer.Option("zero", "--baseline", help="Integrated-gradients baseline: zero or pad."),
        runtime: Runtime = NO_RUNTIME,
    ) -> None:
        """Per-token attribution of one output scalar (class logit or token logit) to the word embeddings."""
        from mixlens.methods.saliency import output_attribution

        tgt: int | str = int(target) if target.lstrip("-").isdigit() else target
        lens = runtime.load(
            model, gguf_file=gguf_file, head=pick_model_head(model_head, head), allow_random_head=allow_random_head
        )
        enc = lens.encode(text)
        with progress(None, kind):
            res = output_attribution(
                lens.trace(enc),
                kind,
                target=tgt,
                position=position,
                reduction=reduction,
                steps=steps,
                baseline=baseline,
            )
        from mixlens.viz.terminal import print_output_attribution

        print_output_attribution(enc.tokens, res)
