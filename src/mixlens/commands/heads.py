"""Head statistics commands: `heads` (per-head token-type masses, column maxima, entropy, clustering) and
`head-diff` (attention change between two checkpoints) (docs/guides/bertology.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from mixlens.commands.options import (
    NO_RUNTIME,
    Dataset,
    Runtime,
    check_view,
    dataset_command,
    figures_option,
    out_dir_option,
    runtime_options,
    table_format_option,
)
from mixlens.commands.output import TableFormat, progress, write_table
from mixlens.viz.labels import model_label


def register(app: typer.Typer) -> None:
    app.command("heads")(runtime_options(heads))
    app.command("head-diff")(runtime_options(head_diff))


@dataset_command
def heads(
    ds: Dataset,
    view: list[str] = typer.Option(None, "--view", help="attn and/or norm (default: both)."),
    fmt: TableFormat = table_format_option(
        "table: print the per-layer summary, write heads.parquet/.csv to --out; csv/json: the table to stdout."
    ),
    out: Path = out_dir_option("mixlens-heads", "Directory for tables and figures."),
    no_cluster: bool = typer.Option(False, "--no-cluster", help="Skip the JS distances and MDS plot."),
    cluster_limit: int = typer.Option(200, "--cluster-limit", min=1, help="Inputs used for JS distances."),
    figures: bool = figures_option("Also write PNG figures (heatmaps, MDS maps) to --out."),
    no_figures: bool = typer.Option(False, "--no-figures", hidden=True, help="Deprecated: figures are now opt-in."),
    runtime: Runtime = NO_RUNTIME,
) -> None:
    """Per-head token-type masses, Kovaleva column maxima and entropy on attention and norm views."""
    from mixlens.stats.clustering import BEHAVIOURS, classical_mds, dominant_behaviour, js_distance
    from mixlens.stats.heads import STATISTICS, VIEWS, head_statistics
    from mixlens.viz.heads import VIEW_WORDS, head_mds_figure, layer_head_heatmap, statistic_words
    from mixlens.viz.terminal import print_frame

    views = [check_view(v) for v in view] if view else list(VIEWS)
    texts = ds.texts()
    lens = ds.load(runtime)
    with progress(len(texts), "heads") as step:
        rep = head_statistics(
            lens,
            texts,
            views=views,
            batch_size=ds.batch_size,
            clustering=not no_cluster,
            cluster_limit=cluster_limit,
            on_batch=step,
        )
    write_table(rep.table, fmt, out, "heads")
    if fmt is TableFormat.table:
        summary = rep.layer_summary()
        cols = ["layer", *[f"{v}_{s}" for v in views for s in STATISTICS]]
        print_frame(summary[cols], f"Per-layer mean over heads — {lens.name}, {len(texts)} inputs")
    if not figures or no_figures:
        return
    written: list[Path] = []
    for v in views:
        for s in (*STATISTICS, "cls_colmax", "sep_colmax", "punct_colmax"):
            words = statistic_words(f"{v}_{s}")
            written.append(out / f"heatmap_{v}_{s}.png")
            layer_head_heatmap(
                rep.grid(f"{v}_{s}"),
                f"Per head: {words} ({lens.name}, {len(texts)} inputs)",
                written[-1],
                label=words.split(",")[0],
            )
    if not no_cluster:
        t = rep.table.sort_values(["layer", "head"])
        for v in views:
            coords = classical_mds(js_distance(rep.js[v]))
            behaviours = dominant_behaviour({b: t[f"{v}_{b}"].to_numpy() for b in BEHAVIOURS})
            written.append(out / f"mds_{v}.png")
            head_mds_figure(
                coords,
                t["layer"].to_numpy(),
                t["head"].to_numpy(),
                behaviours,
                [*BEHAVIOURS, "broad"],
                f"Heads placed by MDS of Jensen–Shannon distances between their maps ({VIEW_WORDS[v]})",
                written[-1],
            )
    typer.echo(f"wrote {len(written)} figures to {out}/: {', '.join(p.name for p in written)}", err=True)


@dataset_command
def head_diff(
    ds: Dataset,
    other: str = typer.Option(..., "--other", help="The second checkpoint (e.g. a fine-tuned model dir)."),
    fmt: TableFormat = table_format_option(),
    out: Path = out_dir_option("mixlens-head-diff", "Directory for table and heatmap."),
    figures: bool = figures_option("Also write the heatmap head_diff.png to --out."),
    runtime: Runtime = NO_RUNTIME,
) -> None:
    """Per (layer, head) cosine similarity of the attention maps of two checkpoints (fine-tuning change)."""
    import pandas as pd

    from mixlens.stats.heads import attention_similarity
    from mixlens.viz.heads import layer_head_heatmap
    from mixlens.viz.terminal import print_frame

    texts = ds.texts()
    a, b = ds.load(runtime), runtime.load(other)
    with progress(len(texts), "head-diff") as step:
        sim = attention_similarity(a, b, texts, batch_size=ds.batch_size, on_batch=step)  # [layer, head]
    df = pd.DataFrame(
        [(la, h, sim[la, h]) for la in range(sim.shape[0]) for h in range(sim.shape[1])],
        columns=["layer", "head", "cosine"],
    )
    write_table(df, fmt, out, "head_diff")
    if fmt is TableFormat.table:
        per = df.groupby("layer")["cosine"].agg(["mean", "min"]).reset_index()
        print_frame(per, f"Attention cosine similarity {a.name} vs {b.name}, {len(texts)} inputs")
    if figures:
        layer_head_heatmap(
            sim,
            f"Cosine similarity of attention maps: {model_label(a.name)} vs {model_label(b.name)}",
            out / "head_diff.png",
            cmap="magma",
            label="cosine similarity",
        )
        typer.echo(f"wrote {out / 'head_diff.png'}", err=True)
