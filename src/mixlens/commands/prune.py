"""`mixlens prune` (heads whose removal helps, confirmed on held-out data) and `mixlens ablate-patterns` (disable
every head of one Kovaleva type at once vs random heads) (docs/guides/bertology.md)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import typer

from mixlens.commands.options import (
    NO_RUNTIME,
    Runtime,
    batch_size_option,
    check_limit,
    data_option,
    disable_option,
    gguf_file_option,
    label_column_option,
    limit_option,
    metric_option,
    model_option,
    option_block,
    pair_column_option,
    read_examples,
    runtime_options,
    score_column_option,
    text_column_option,
    writable_dir,
)
from mixlens.commands.output import progress
from mixlens.commands.sweep import METRICS, make_task, metric_for
from mixlens.errors import MixlensError


def register(app: typer.Typer) -> None:
    app.command("prune")(runtime_options(prune_command))
    app.command("ablate-patterns")(runtime_options(ablate_patterns_command))


TASK_OPTIONS = (  # the data, model and metric of the task the heads are disabled on (prune, ablate-patterns)
    ("data", str, data_option()),
    ("model", str | None, model_option()),
    ("gguf_file", str | None, gguf_file_option()),
    ("metric", str | None, metric_option()),
    ("text_column", str | None, text_column_option()),
    ("pair_column", str | None, pair_column_option()),
    ("score_column", str, score_column_option()),
    ("label_column", str, label_column_option()),
    ("limit", int | None, limit_option()),
    ("batch_size", int, batch_size_option()),
)


def _examples(opts: SimpleNamespace) -> list[Any]:
    """The examples of a `TASK_OPTIONS` block (the metric name checked first)."""
    if opts.metric is not None and opts.metric not in METRICS:
        raise MixlensError(f"unknown metric '{opts.metric}'; valid: {', '.join(METRICS)}")
    return read_examples(opts.data, opts.text_column, opts.pair_column, check_limit(opts.limit))


def _lens(opts: SimpleNamespace, runtime: Runtime) -> tuple[Any, str]:
    """The model of a `TASK_OPTIONS` block (loaded with `runtime`) and its metric (by default the one its head calls
    for)."""
    lens = runtime.load(opts.model, gguf_file=opts.gguf_file)
    return lens, opts.metric or metric_for(lens)


def _task(lens: Any, metric: str, opts: SimpleNamespace, examples: list[Any]) -> Any:
    return make_task(lens, metric, examples, opts.score_column, opts.label_column, opts.batch_size)


@option_block(*TASK_OPTIONS)
def prune_command(
    opts: SimpleNamespace,
    held_out: float = typer.Option(0.5, "--held-out", help="Fraction of the examples kept apart to confirm."),
    seed: int = typer.Option(0, "--seed", help="Seed of the split and of the bootstrap."),
    max_heads: int | None = typer.Option(None, "--max-heads", min=1, help="Remove at most this many heads."),
    min_gain: float = typer.Option(0.0, "--min-gain", min=0.0, help="Smallest selection-split gain that counts."),
    resamples: int = typer.Option(
        1000, "--resamples", min=100, max=100_000, help="Bootstrap resamples of the held-out split."
    ),  # max: `bertology.prune.MAX_RESAMPLES` (checked before the model loads)
    disable: str | None = disable_option(),
    save: Path | None = typer.Option(None, "--save", help="Write a checkpoint with the chosen heads removed."),
    out: Path = typer.Option(
        Path("mixlens-prune"), "--out", "-o", help="Directory for the tables.", callback=writable_dir
    ),
    runtime: Runtime = NO_RUNTIME,
) -> None:
    """Remove heads whose removal improves the metric on a selection split; confirm on a held-out split."""
    import json

    import pandas as pd

    from mixlens.bertology.prune import check_save_target, prune, split_indices
    from mixlens.bertology.sweep import sweep_steps
    from mixlens.interventions import disabled, parse_heads
    from mixlens.lens import resolve_source
    from mixlens.result import atomic_write
    from mixlens.viz.terminal import print_prune

    if save is not None:  # before any work: never onto the source checkpoint, a file or someone else's folder
        src, local = resolve_source(opts.model, opts.gguf_file)
        check_save_target(save, src if local else None)
    examples = _examples(opts)
    sel_idx, held_idx = split_indices(len(examples), held_out, seed)
    lens, metric = _lens(opts, runtime)
    base_off = parse_heads(disable or "", lens)
    selection, heldout = (_task(lens, metric, opts, [examples[i] for i in idx]) for idx in (sel_idx, held_idx))
    with (
        disabled(lens, base_off),
        progress(sweep_steps(lens, selection, "zero") + lens.adapter.n_layers * lens.adapter.n_heads, "prune") as step,
    ):
        res = prune(
            lens,
            selection,
            heldout,
            max_heads=max_heads,
            min_gain=min_gain,
            n_resamples=resamples,
            seed=seed,
            on_step=step,
        )
    lo, hi = res.ci
    print_prune(res, resamples)
    steps = pd.DataFrame(res.steps, columns=["head", f"selection_{res.metric}", "kept"])
    summary = {
        "metric": res.metric,
        "heads": res.spec,
        "selection_baseline": res.selection_baseline,
        "selection_score": res.selection_score,
        "heldout_baseline": res.heldout_baseline,
        "heldout_score": res.heldout_score,
        "heldout_delta": res.heldout_delta,
        "ci95": [lo, hi],
        "confirmed": res.confirmed,
        "n_selection": res.n_selection,
        "n_heldout": res.n_heldout,
        "disabled_before": disable or "",
    }
    if save is not None:
        summary["saved"] = save_checkpoint(lens, [*expand(lens, base_off), *res.heads], heldout, save)
    from mixlens.jsonio import finite, summarize_paths

    clean, where = finite(summary)
    if where:  # e.g. a correlation of a constant score: JSON has no NaN
        note = f"not a number (written as null): {summarize_paths(where)}"
        clean["notes"] = [note]
        print(f"note: {note}")
    atomic_write(out / "prune_steps.csv", steps.to_csv(index=False).encode())
    atomic_write(out / "prune.json", (json.dumps(clean, indent=1, allow_nan=False) + "\n").encode())
    typer.echo(f"wrote {out}/prune.json and prune_steps.csv", err=True)


def expand(lens: Any, ablations: Any) -> list[tuple[int, int]]:
    """Ablations → (layer, head) pairs (a whole layer → all its heads)."""
    n = lens.adapter.n_heads
    return [(a.layer, h) for a in ablations for h in (range(n) if a.heads is None else a.heads)]


def save_checkpoint(lens: Any, heads: list[tuple[int, int]], task: Any, path: Path) -> dict[str, Any]:
    """Check the pruned model against zero ablation, then write its checkpoint; report parameters, forward time and
    the match. Nothing is written when the check fails."""
    import torch

    from mixlens.bertology.prune import ablations_for, forward_seconds, n_parameters, pruned_copies, write_checkpoint
    from mixlens.interventions import disabled
    from mixlens.trace import hooked

    if not heads:
        raise MixlensError("no head to remove: nothing to --save")
    dense, pruned = pruned_copies(lens, heads)
    inputs = task.batches[-1]  # the longest inputs
    with torch.no_grad(), disabled(lens, ablations_for(heads)), hooked(lens.adapter):
        want = lens.model(**inputs)[0]
    with torch.no_grad():
        got, got_dense = pruned(**inputs)[0], dense(**inputs)[0]
    mask = inputs["attention_mask"].bool()
    per_token = got.dim() == 3 and got.shape[:2] == mask.shape  # hidden states or token logits; else [batch, classes]
    diff = float(max(((g - want)[mask] if per_token else g - want).abs().max() for g in (got, got_dense)))
    if diff > 1e-4:
        raise MixlensError(f"the pruned model differs from zero ablation by {diff:.2e}; nothing saved")
    write_checkpoint(dense, lens.tokenizer, path)
    p0, p1 = n_parameters(lens.model), n_parameters(pruned)
    t0, t1 = forward_seconds(lens.model, inputs), forward_seconds(pruned, inputs)
    print(
        f"saved {path} (the removed heads zero; load_pruned drops them): {p1:,} parameters once dropped (original "
        f"{p0:,}, −{100 * (p0 - p1) / p0:.1f} %); pruned forward {1000 * t1:.1f} ms vs original {1000 * t0:.1f} ms "
        f"on {inputs['input_ids'].shape[0]} inputs; max |output − zero-ablated output| = {diff:.2e}"
    )
    return {
        "path": str(path),
        "parameters": p1,
        "parameters_original": p0,
        "forward_s": t1,
        "forward_s_original": t0,
        "max_abs_diff_vs_zero_ablation": diff,
    }


@option_block(*TASK_OPTIONS)
def ablate_patterns_command(
    opts: SimpleNamespace,
    mode: str = typer.Option("uniform", "--mode", help="uniform (Kovaleva) or zero."),
    draws: int = typer.Option(5, "--draws", help="Random head sets per type (the control)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random heads."),
    view: str = typer.Option("attn", "--view", help="attn or norm: the maps the pattern types come from."),
    disable: str | None = disable_option(),
    out: Path = typer.Option(
        Path("mixlens-ablate-patterns"), "--out", "-o", help="Directory for table, figure.", callback=writable_dir
    ),
    runtime: Runtime = NO_RUNTIME,
) -> None:
    """Disable every head of one Kovaleva pattern type at once; compare with as many random heads."""
    import pandas as pd

    from mixlens.bertology.pattern_ablation import MODES, ablate_patterns, head_types, pattern_ablation_steps
    from mixlens.commands.options import check_view
    from mixlens.interventions import disabled, parse_heads
    from mixlens.result import atomic_write
    from mixlens.stats.patterns import classify_inputs
    from mixlens.viz.heads import pattern_ablation_figure
    from mixlens.viz.terminal import print_pattern_ablation

    check_view(view)
    if mode not in MODES:
        raise MixlensError(f"unknown ablation mode '{mode}' for pattern ablation; valid: {', '.join(MODES)}")
    examples = _examples(opts)
    lens, metric = _lens(opts, runtime)
    task = _task(lens, metric, opts, examples)
    texts = [t for e in examples for t in (e.text if metric == "sts" else (e.text,))]
    with disabled(lens, parse_heads(disable or "", lens)):
        with progress(len(texts), "pattern types") as step:
            types = head_types(classify_inputs(lens, texts, view=view, batch_size=opts.batch_size, on_batch=step))
        with progress(pattern_ablation_steps(types, draws), f"ablate ({metric}, {mode})") as step:
            res = ablate_patterns(lens, task, types, mode, draws, seed, on_step=step)
    df = pd.DataFrame(
        res.rows(), columns=["type", "heads", res.metric, "delta", "random_delta_mean", "random_delta_sd"]
    )
    print_pattern_ablation(res, task.n_examples, df)
    atomic_write(out / "ablate_patterns.csv", df.to_csv(index=False).encode())
    kinds = pd.DataFrame(
        [(la, h, res.types[la, h]) for la in range(res.types.shape[0]) for h in range(res.types.shape[1])],
        columns=["layer", "head", "type"],
    )
    atomic_write(out / "head_types.csv", kinds.to_csv(index=False).encode())
    pattern_ablation_figure(res, out / "ablate_patterns.png")
    typer.echo(f"wrote {out}/ablate_patterns.csv, head_types.csv and ablate_patterns.png", err=True)
