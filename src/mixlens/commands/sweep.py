"""`mixlens sweep`: disable every head and every layer, report the change of a task metric
(docs/guides/bertology.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
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
    model_option,
    pair_column_option,
    read_examples,
    runtime_options,
    score_column_option,
    text_column_option,
    writable_dir,
)
from mixlens.commands.output import progress
from mixlens.errors import MixlensError

METRICS = ("sts", "mlm", "accuracy")
METRIC_FOR_HEAD = {"base": "sts", "masked-lm": "mlm", "sequence-classification": "accuracy"}


def register(app: typer.Typer) -> None:
    app.command("sweep")(runtime_options(sweep_command))


def sweep_command(
    data: str = data_option(),
    model: str | None = model_option(),
    gguf_file: str | None = gguf_file_option(),
    metric: str | None = typer.Option(
        None,
        "--metric",
        help="sts (sentence-embedding model), mlm (masked LM) or accuracy (classifier); default from the model head.",
    ),
    mode: str = typer.Option("uniform", "--mode", help="uniform (Kovaleva), zero or mean."),
    text_column: str | None = text_column_option(),
    pair_column: str | None = pair_column_option(),
    score_column: str = score_column_option(),
    label_column: str = label_column_option(),
    limit: int | None = limit_option(),
    batch_size: int = batch_size_option(),
    disable: str | None = disable_option(),
    out: Path = typer.Option(
        Path("mixlens-sweep"), "--out", "-o", help="Directory for table and heatmap.", callback=writable_dir
    ),
    runtime: Runtime = NO_RUNTIME,
) -> None:
    """Disable every single head and every whole layer; report the change of a task metric."""
    import pandas as pd

    from mixlens.bertology.sweep import sweep, sweep_steps
    from mixlens.interventions import MODES, disabled, parse_heads
    from mixlens.result import atomic_write
    from mixlens.viz.heads import sweep_figure
    from mixlens.viz.terminal import print_sweep

    if mode not in MODES:
        raise MixlensError(f"unknown ablation mode '{mode}'; valid: {', '.join(MODES)}")
    if metric is not None and metric not in METRICS:
        raise MixlensError(f"unknown metric '{metric}'; valid: {', '.join(METRICS)}")
    examples = read_examples(data, text_column, pair_column, check_limit(limit))
    lens = runtime.load(model, gguf_file=gguf_file)
    off = parse_heads(disable or "", lens)
    metric = metric or metric_for(lens)
    task = make_task(lens, metric, examples, score_column, label_column, batch_size)
    with disabled(lens, off), progress(sweep_steps(lens, task, mode), f"sweep ({metric}, {mode})") as step:
        res = sweep(lens, task, mode, on_step=step)
    what = f"heads {disable} disabled" if off else "no ablation"
    n_layers, n_heads = res.heads.shape
    rows: list[tuple[int, int | str, float, float]] = [
        (la, h, res.heads[la, h], res.delta_heads[la, h]) for la in range(n_layers) for h in range(n_heads)
    ]
    rows += [(la, "all", res.layers[la], res.delta_layers[la]) for la in range(n_layers)]
    df = pd.DataFrame(rows, columns=["layer", "head", res.metric, "delta"])
    print_sweep(res, what)
    atomic_write(out / "sweep.csv", df.to_csv(index=False).encode())
    sweep_figure(res, out / "sweep.png")
    typer.echo(f"wrote {out}/sweep.csv and sweep.png", err=True)


def metric_for(lens: Any) -> str:
    """The default metric for the model's head."""
    from mixlens.lens import head_for

    return METRIC_FOR_HEAD.get(head_for(lens.model.config), "sts")


def make_task(
    lens: Any, metric: str, examples: list[Any], score_column: str, label_column: str, batch_size: int
) -> Any:
    """The sweep's task for `metric` over the examples, with gold values from their columns."""
    from mixlens.bertology.tasks import ClassificationTask, MlmTask, StsTask

    if metric == "sts":
        if not isinstance(examples[0].text, tuple):
            raise MixlensError(
                "the sts metric needs sentence pairs (give --pair-column, or columns sentence1/sentence2)"
            )
        return StsTask(lens, [e.text for e in examples], column(examples, score_column, float), batch_size)
    if metric == "mlm":
        return MlmTask(lens, [e.text if isinstance(e.text, str) else e.text[0] for e in examples], batch_size)
    labels = column(examples, label_column, lambda v: label_id(lens, v))
    return ClassificationTask(lens, [e.text for e in examples], labels, batch_size)


def label_id(lens: Any, value: object) -> int:
    """A gold label as a class index: an integer, or a name from the model's label2id."""
    s = str(value).strip()
    l2i = getattr(lens.model.config, "label2id", None) or {}
    n = getattr(lens.model.config, "num_labels", None) or len(l2i)
    classes = ", ".join(f"{i} {name}" for name, i in sorted(l2i.items(), key=lambda kv: kv[1])) or f"0..{n - 1}"
    if s.isascii() and s.lstrip("-").isdigit():
        k = int(s)
        if n and not 0 <= k < n:
            raise MixlensError(f"gold label {k} is not a class of the model; its {n} classes: {classes}")
        return k
    if s in l2i:
        return int(l2i[s])
    raise MixlensError(f"label '{s[:40]}' is neither a class index nor one of the model's labels; classes: {classes}")


def column(examples: list[Any], name: str, conv: Callable[[Any], Any]) -> list[Any]:
    """Column `name` of every example, converted; a missing column or bad value is a user error."""
    if name not in examples[0].fields:
        raise MixlensError(f"no column '{name}' in the data; columns: {', '.join(examples[0].fields)}")
    try:
        return [conv(e.fields[name]) for e in examples]
    except ValueError as e:
        raise MixlensError(f"column '{name}': {e}") from None
