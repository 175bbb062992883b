"""BERTology commands: `heads`, `syntax`, `patterns`, `sweep`, `head-diff` (docs/bertology.md)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from enum import Enum
from pathlib import Path

import numpy as np
import typer

from mixlens.errors import MixlensError


class TableFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


# ------------------------------------------------------------------------------------------------ helpers


def read_examples(data: str, text_column: str | None, pair_column: str | None, limit: int | None) -> list:
    """The first `limit` examples of a data file (through the shared corpus readers)."""
    from mixlens.corpus.readers import iter_examples

    out = []
    for ex in iter_examples(data, text_column, pair_column):
        if limit is not None and len(out) >= limit:
            break
        out.append(ex)
    return out


@contextmanager
def progress(total: int, what: str):
    """A rich progress bar on stderr; yields `advance(n)`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heatmap(grid: np.ndarray, title: str, path: Path, cmap: str = "viridis", center: bool = False) -> None:
    """A layer × head heatmap [L, H] with values written in the cells."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(0.55 * grid.shape[1] + 2, 0.45 * grid.shape[0] + 1.5))
    lim = np.nanmax(np.abs(grid)) if center else None
    im = ax.imshow(grid, cmap=cmap, aspect="auto", vmin=-lim if center else None, vmax=lim)
    for (r, c), v in np.ndenumerate(grid):
        ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if not center else "k")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(grid.shape[1]))
    ax.set_yticks(range(grid.shape[0]))
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_table(df, fmt: TableFormat, out_dir: Path, stem: str) -> None:
    """csv/json: to stdout; parquet/table: `out_dir/stem.parquet` (and a CSV beside it)."""
    from mixlens.result import atomic_write

    if fmt is TableFormat.csv:
        sys.stdout.write(df.to_csv(index=False))
    elif fmt is TableFormat.json:
        sys.stdout.write(df.to_json(orient="records", force_ascii=False) + "\n")
    else:
        import io

        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
        atomic_write(out_dir / f"{stem}.parquet", buf.getvalue())
        atomic_write(out_dir / f"{stem}.csv", df.to_csv(index=False).encode())
        typer.echo(f"wrote {out_dir / stem}.parquet and .csv", err=True)


def print_frame(df, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in df.columns:
        table.add_column(str(c), justify="right")
    for row in df.itertuples(index=False):
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
    Console(stderr=True).print(table)


def _texts(examples: list) -> list:
    return [ex.text for ex in examples]


def _limit(limit: int | None) -> int | None:
    if limit is not None and limit < 1:
        raise MixlensError("--limit must be at least 1")
    return limit


DATA = typer.Option(..., "--data", "-d", help="TSV/CSV/JSONL/Parquet/plain-text file.")
TEXT_COL = typer.Option(None, "--text-column", help="Column holding the text (default: sentence/text/...).")
PAIR_COL = typer.Option(None, "--pair-column", help="Column holding the second text of a pair.")
LIMIT = typer.Option(None, "--limit", "-n", help="Use only the first N examples.")
BATCH = typer.Option(32, "--batch-size", min=1, help="Inputs per forward pass.")


def _model_opt() -> typer.models.OptionInfo:
    from mixlens.cli import model_option

    return model_option()


# ------------------------------------------------------------------------------------------------ commands


def register(app: typer.Typer) -> None:
    @app.command("heads")
    def heads_cmd(
        data: str = DATA,
        model: str | None = _model_opt(),
        text_column: str | None = TEXT_COL,
        pair_column: str | None = PAIR_COL,
        limit: int | None = LIMIT,
        batch_size: int = BATCH,
        view: list[str] = typer.Option(None, "--view", help="attn and/or norm (default: both)."),
        fmt: TableFormat = typer.Option(TableFormat.table, "--format", "-f", help="table: print the per-layer "
                                        "summary, write heads.parquet/.csv to --out; csv/json: the table to "
                                        "stdout."),
        out: Path = typer.Option(Path("mixlens-heads"), "--out", "-o", help="Directory for tables and figures."),
        no_cluster: bool = typer.Option(False, "--no-cluster", help="Skip the JS distances and MDS plot."),
        cluster_limit: int = typer.Option(200, "--cluster-limit", min=1, help="Inputs used for JS distances."),
        no_figures: bool = typer.Option(False, "--no-figures", help="Skip the figures."),
    ) -> None:
        """Per-head token-type masses, Kovaleva column maxima and entropy on attention and norm views."""
        from mixlens.lens import load
        from mixlens.stats.heads import STATISTICS, VIEWS, head_statistics

        views = list(view) if view else list(VIEWS)
        for v in views:
            if v not in VIEWS:
                raise MixlensError(f"unknown view '{v}'; valid: {', '.join(VIEWS)}")
        texts = _texts(read_examples(data, text_column, pair_column, _limit(limit)))
        lens = load(model)
        with progress(len(texts), "heads") as step:
            rep = head_statistics(lens, texts, views=views, batch_size=batch_size, clustering=not no_cluster,
                                  cluster_limit=cluster_limit, on_batch=step)
        write_table(rep.table, fmt, out, "heads")
        if fmt is TableFormat.table:
            summary = rep.layer_summary()
            cols = ["layer", *[f"{v}_{s}" for v in views for s in STATISTICS]]
            print_frame(summary[cols], f"Per-layer mean over heads — {lens.name}, {len(texts)} inputs")
        if not no_figures:
            for v in views:
                for s in (*STATISTICS, "cls_colmax", "sep_colmax", "punct_colmax"):
                    heatmap(rep.grid(f"{v}_{s}"), f"{v}_{s} ({lens.name}, {len(texts)} inputs)",
                            out / f"heatmap_{v}_{s}.png")
            if not no_cluster:
                for v in views:
                    _mds_figure(rep, v, out / f"mds_{v}.png")
            typer.echo(f"wrote figures to {out}/", err=True)

    @app.command("syntax")
    def syntax_cmd(
        data: str = typer.Option(..., "--data", "-d", help="CoNLL-U file (e.g. UD English EWT dev)."),
        model: str | None = _model_opt(),
        limit: int | None = typer.Option(None, "--limit", "-n", help="Use only the first N sentences."),
        batch_size: int = BATCH,
        view: str = typer.Option("attn", "--view", help="attn or norm."),
        min_count: int = typer.Option(20, "--min-count", help="Report relations with at least this many arcs."),
        fmt: TableFormat = typer.Option(TableFormat.table, "--format", "-f", help="Format of the best-head "
                                        "table (csv/json to stdout)."),
        out: Path = typer.Option(Path("mixlens-syntax"), "--out", "-o", help="Directory for tables."),
    ) -> None:
        """Dependency-head accuracy of every head per relation (both directions) with offset baselines."""
        from mixlens.lens import load
        from mixlens.result import atomic_write
        from mixlens.stats.heads import VIEWS
        from mixlens.stats.syntax import read_conllu, syntax_heads

        if view not in VIEWS:
            raise MixlensError(f"unknown view '{view}'; valid: {', '.join(VIEWS)}")
        sents = list(read_conllu(data, _limit(limit)))
        lens = load(model)
        with progress(len(sents), "syntax") as step:
            rep = syntax_heads(lens, sents, view=view, batch_size=batch_size, on_batch=step)
        best = rep.best(min_count)
        atomic_write(out / "syntax_scores.csv", rep.scores.to_csv(index=False).encode())
        write_table(best, fmt, out, "syntax_best")
        if fmt is TableFormat.table:
            print_frame(best, f"Best head per relation ({view}) — {lens.name}, {len(sents)} sentences")

    @app.command("patterns")
    def patterns_cmd(
        data: str = DATA,
        model: str | None = _model_opt(),
        text_column: str | None = TEXT_COL,
        pair_column: str | None = PAIR_COL,
        limit: int | None = LIMIT,
        batch_size: int = BATCH,
        view: str = typer.Option("attn", "--view", help="attn or norm."),
        fmt: TableFormat = typer.Option(TableFormat.table, "--format", "-f"),
        out: Path = typer.Option(Path("mixlens-patterns"), "--out", "-o", help="Directory for table and figure."),
    ) -> None:
        """Share of each Kovaleva pattern type (vertical, diagonal, ...) per layer over a dataset."""
        import pandas as pd

        from mixlens.lens import load
        from mixlens.stats.heads import VIEWS
        from mixlens.stats.patterns import PATTERNS, classify_inputs, pattern_shares

        if view not in VIEWS:
            raise MixlensError(f"unknown view '{view}'; valid: {', '.join(VIEWS)}")
        texts = _texts(read_examples(data, text_column, pair_column, _limit(limit)))
        lens = load(model)
        with progress(len(texts), "patterns") as step:
            labels = classify_inputs(lens, texts, view=view, batch_size=batch_size, on_batch=step)
        shares = pattern_shares(labels)
        df = pd.DataFrame(shares, columns=list(PATTERNS))
        df.insert(0, "layer", range(len(df)))
        write_table(df, fmt, out, "patterns")
        if fmt is TableFormat.table:
            print_frame(df, f"Pattern-type share per layer ({view}) — {lens.name}, {len(texts)} inputs")
        _shares_figure(shares, f"pattern types ({view}, {len(texts)} inputs)", out / "patterns.png")

    @app.command("sweep")
    def sweep_cmd(
        data: str = DATA,
        model: str | None = _model_opt(),
        metric: str | None = typer.Option(None, "--metric", help="sts (sentence-embedding model), mlm (masked "
                                          "LM) or accuracy (classifier); default from the model head."),
        mode: str = typer.Option("uniform", "--mode", help="uniform (Kovaleva), zero or mean."),
        text_column: str | None = TEXT_COL,
        pair_column: str | None = PAIR_COL,
        score_column: str = typer.Option("score", "--score-column", help="Gold similarity column (sts)."),
        label_column: str = typer.Option("label", "--label-column", help="Gold label column (accuracy)."),
        limit: int | None = LIMIT,
        batch_size: int = BATCH,
        out: Path = typer.Option(Path("mixlens-sweep"), "--out", "-o", help="Directory for table and heatmap."),
    ) -> None:
        """Disable every single head and every whole layer; report the change of a task metric."""
        import pandas as pd

        from mixlens.bertology.sweep import sweep, sweep_steps
        from mixlens.interventions import MODES
        from mixlens.lens import _head_for, load
        from mixlens.result import atomic_write

        if mode not in MODES:
            raise MixlensError(f"unknown ablation mode '{mode}'; valid: {', '.join(MODES)}")
        if metric is not None and metric not in ("sts", "mlm", "accuracy"):
            raise MixlensError(f"unknown metric '{metric}'; valid: sts, mlm, accuracy")
        examples = read_examples(data, text_column, pair_column, _limit(limit))
        lens = load(model)
        metric = metric or {"base": "sts", "masked-lm": "mlm", "sequence-classification": "accuracy"}.get(
            _head_for(lens.model.config), "sts")
        task = _task(lens, metric, examples, score_column, label_column, batch_size)
        with progress(sweep_steps(lens, task, mode), f"sweep ({metric}, {mode})") as step:
            res = sweep(lens, task, mode, on_step=step)
        print(f"baseline {res.metric} (no ablation, {res.n_examples} examples): {res.baseline:.4f}")
        n_layers, n_heads = res.heads.shape
        rows = [(la, h, res.heads[la, h], res.delta_heads[la, h]) for la in range(n_layers) for h in range(n_heads)]
        rows += [(la, "all", res.layers[la], res.delta_layers[la]) for la in range(n_layers)]
        df = pd.DataFrame(rows, columns=["layer", "head", res.metric, "delta"])
        atomic_write(out / "sweep.csv", df.to_csv(index=False).encode())
        print("largest harms (ablated − baseline):")
        for name, d in res.top_changes(10):
            print(f"  {name:8s} {d:+.4f}")
        grid = np.concatenate([res.delta_heads, res.delta_layers[:, None]], 1)
        heatmap(grid, f"Δ{res.metric} ({mode}; last column = whole layer; baseline {res.baseline:.3f})",
                out / "sweep.png", cmap="RdBu" if res.higher_is_better else "RdBu_r", center=True)
        typer.echo(f"wrote {out}/sweep.csv and sweep.png", err=True)

    @app.command("head-diff")
    def head_diff_cmd(
        data: str = DATA,
        model: str | None = _model_opt(),
        other: str = typer.Option(..., "--other", help="The second checkpoint (e.g. a fine-tuned model dir)."),
        text_column: str | None = TEXT_COL,
        pair_column: str | None = PAIR_COL,
        limit: int | None = LIMIT,
        batch_size: int = BATCH,
        fmt: TableFormat = typer.Option(TableFormat.table, "--format", "-f"),
        out: Path = typer.Option(Path("mixlens-head-diff"), "--out", "-o", help="Directory for table and heatmap."),
    ) -> None:
        """Per (layer, head) cosine similarity of the attention maps of two checkpoints (fine-tuning change)."""
        import pandas as pd

        from mixlens.lens import load
        from mixlens.stats.heads import attention_similarity

        texts = _texts(read_examples(data, text_column, pair_column, _limit(limit)))
        a, b = load(model), load(other)
        with progress(len(texts), "head-diff") as step:
            sim = attention_similarity(a, b, texts, batch_size=batch_size, on_batch=step)
        df = pd.DataFrame([(la, h, sim[la, h]) for la in range(sim.shape[0]) for h in range(sim.shape[1])],
                          columns=["layer", "head", "cosine"])
        write_table(df, fmt, out, "head_diff")
        if fmt is TableFormat.table:
            per = df.groupby("layer")["cosine"].agg(["mean", "min"]).reset_index()
            print_frame(per, f"Attention cosine similarity {a.name} vs {b.name}, {len(texts)} inputs")
        heatmap(sim, f"attention cosine: {a.name} vs {b.name}", out / "head_diff.png", cmap="magma")


def _task(lens, metric: str, examples: list, score_column: str, label_column: str, batch_size: int):
    from mixlens.bertology.tasks import ClassificationTask, MlmTask, StsTask

    if metric == "sts":
        if not isinstance(examples[0].text, tuple):
            raise MixlensError("the sts metric needs sentence pairs (give --pair-column, or columns "
                               "sentence1/sentence2)")
        return StsTask(lens, [e.text for e in examples], _column(examples, score_column, float), batch_size)
    if metric == "mlm":
        return MlmTask(lens, [e.text if isinstance(e.text, str) else e.text[0] for e in examples], batch_size)
    labels = _column(examples, label_column, lambda v: _label(lens, v))
    return ClassificationTask(lens, [e.text for e in examples], labels, batch_size)


def _label(lens, value) -> int:
    s = str(value).strip()
    if s.lstrip("-").isdigit():
        return int(s)
    l2i = getattr(lens.model.config, "label2id", None) or {}
    if s in l2i:
        return int(l2i[s])
    raise MixlensError(f"label '{s}' is neither an integer nor one of the model's labels {sorted(l2i)}")


def _column(examples: list, name: str, conv: Callable) -> list:
    if name not in examples[0].fields:
        raise MixlensError(f"no column '{name}' in the data; columns: {', '.join(examples[0].fields)}")
    try:
        return [conv(e.fields[name]) for e in examples]
    except ValueError as e:
        raise MixlensError(f"column '{name}': {e}") from None


def _mds_figure(rep, view: str, path: Path) -> None:
    from mixlens.stats.clustering import BEHAVIOURS, classical_mds, dominant_behaviour, js_distance

    plt = _plt()
    coords = classical_mds(js_distance(rep.js[view]))
    t = rep.table.sort_values(["layer", "head"])
    labels = dominant_behaviour({b: t[f"{view}_{b}"].to_numpy() for b in BEHAVIOURS})
    fig, ax = plt.subplots(figsize=(7, 6))
    for k, beh in enumerate([*BEHAVIOURS, "broad"]):
        sel = labels == beh
        if sel.any():
            ax.scatter(coords[sel, 0], coords[sel, 1], label=beh, color=plt.cm.tab10(k), s=30)
    for i, (la, h) in enumerate(zip(t["layer"], t["head"], strict=True)):
        ax.annotate(f"{la}-{h}", coords[i], fontsize=5, alpha=0.7)
    ax.legend(title="dominant behaviour", fontsize=7)
    ax.set_title(f"Heads, MDS of Jensen–Shannon distances ({view}); label = layer-head", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shares_figure(shares: np.ndarray, title: str, path: Path) -> None:
    from mixlens.stats.patterns import PATTERNS

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = np.zeros(shares.shape[0])
    for k, p in enumerate(PATTERNS):
        ax.bar(range(shares.shape[0]), shares[:, k], bottom=bottom, label=p, color=plt.cm.tab10(k))
        bottom += shares[:, k]
    ax.set_xlabel("layer")
    ax.set_ylabel("share of heads × inputs")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
