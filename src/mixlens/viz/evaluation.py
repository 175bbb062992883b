"""Publication figure of `mixlens evaluate`: deletion curves with 95 % intervals, and the AOPC ranking; for a
contrastive task (`--task blimp`) the alignment with the evidence (MRR) ranked, beside the AOPC."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from mixlens.viz.labels import model_label


def plot(ev, path: str | Path, dpi: int = 200) -> None:
    """Left: mean f(x without top-K %) vs K per method (bands: bootstrap 95 %). Right: AOPC per method, ranked.
    Without removal (`--removal none`) one panel: the metric that was computed, ranked (`plot_ranking`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if ev.removal == "none":
        plot_ranking(ev, path, dpi)
        return
    if ev.task != "faithfulness":  # a contrastive task exists for the alignment with the evidence
        plot_alignment(ev, path, dpi)
        return

    curves, met, ranked = ev.curves(), ev.metrics(), ev.ranking()
    colours = plt.get_cmap("tab20")(np.linspace(0, 1, max(2, len(ranked))))
    legend_rows = math.ceil(len(ranked) / 3)  # the legend sits below the curves, three methods a row
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2 + 0.16 * legend_rows), gridspec_kw={"width_ratios": [1.4, 1]})
    for c, m in zip(colours, ranked, strict=False):
        cv = curves[m]
        style = {"color": "0.3", "ls": "--"} if m == "random" else {"color": c}
        ax.plot(cv["k"], cv["mean"], lw=1.4, label=m, **style)
        ax.fill_between(cv["k"], cv["low"], cv["high"], alpha=0.15, color=style["color"], lw=0)
    ax.set_xlabel("top-K % of the tokens removed")
    ax.set_ylabel("f(x without top-K)")
    ax.set_title(f"Deletion curves ({ev.removal}), {len(ev.examples)} examples")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below the data
    aopc = np.array([met[m]["aopc"] for m in ranked])
    _ranked_bars(bx, ranked, aopc, np.array([met[m]["ci95"]["aopc"] for m in ranked]), colours)
    bx.set_xlabel("AOPC (higher = more faithful)")
    bx.set_title("Ranking")
    fig.suptitle(model_label(ev.model), fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), dpi=dpi)
    plt.close(fig)


def plot_ranking(ev, path: str | Path, dpi: int = 200) -> None:
    """One panel of horizontal bars with 95 % intervals, best first: a contrastive task's MRR with the evidence
    (all groups pooled), else the agreement ρ with G×I."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if ev.task != "faithfulness":
        from mixlens.explain.evidence import ALL, task_metrics

        pooled: Any = task_metrics(ev)[ALL]["all"]
        value = {m: (pooled[m]["mrr"], pooled[m]["ci95"]["mrr"]) for m in ev.methods}
        label = f"MRR with the evidence, {len(ev.examples)} prompts (higher: aligned)"
    else:
        met = ev.metrics()
        value = {m: (met[m]["spearman_gxi"], met[m]["ci95"]["spearman_gxi"]) for m in ev.methods}
        label = f"Spearman ρ with G×I, {len(ev.examples)} examples"
    ranked = sorted(ev.methods, key=lambda m: -np.nan_to_num(value[m][0], nan=-np.inf))
    mean = np.array([value[m][0] for m in ranked], dtype=float)
    ci = np.array([value[m][1] for m in ranked], dtype=float)
    colours = plt.get_cmap("tab20")(np.linspace(0, 1, max(2, len(ranked))))
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.32 * len(ranked)))
    _ranked_bars(ax, ranked, mean, ci, colours)
    ax.set_xlabel(label)
    ax.set_title(f"{model_label(ev.model)} — no removal", fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), dpi=dpi)
    plt.close(fig)


def plot_alignment(ev, path: str | Path, dpi: int = 200) -> None:
    """A contrastive task with removal: left, the MRR with the evidence per method (all groups pooled, 95 %
    intervals, best first) — what the task measures; right, the AOPC on the logit difference, in the same order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mixlens.explain.evidence import ALL, task_metrics

    pooled: Any = task_metrics(ev)[ALL]["all"]
    ranked = sorted(ev.methods, key=lambda m: -np.nan_to_num(pooled[m]["mrr"], nan=-np.inf))
    colours = plt.get_cmap("tab20")(np.linspace(0, 1, max(2, len(ranked))))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 1.2 + 0.32 * len(ranked)), sharey=True)
    for axis, key, label in (
        (ax, "mrr", f"MRR with the evidence, {len(ev.examples)} prompts (higher: aligned)"),
        (bx, "aopc", f"AOPC of the logit difference ({ev.removal}; higher: more faithful)"),
    ):
        mean = np.array([pooled[m][key] for m in ranked], dtype=float)
        ci = np.array([pooled[m]["ci95"][key] for m in ranked], dtype=float)
        _ranked_bars(axis, ranked, mean, ci, colours)
        axis.set_xlabel(label)
    ax.set_title("Alignment (ranked)", fontsize=9)
    bx.set_title("Deletion", fontsize=9)
    fig.suptitle(f"{model_label(ev.model)} — {ev.task}", fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), dpi=dpi)
    plt.close(fig)


def _ranked_bars(ax, ranked: list[str], mean: np.ndarray, ci: np.ndarray, colours) -> None:
    """Horizontal bars of `mean` [M] with 95 % intervals `ci` [M, 2], best on top; random in grey."""
    y = np.arange(len(ranked))[::-1]
    colour = [("0.6" if m == "random" else colours[k]) for k, m in enumerate(ranked)]
    ax.barh(y, mean, xerr=np.abs(ci.T - mean), color=colour, capsize=2)
    ax.set_yticks(y, ranked, fontsize=8)
    ax.grid(axis="x", alpha=0.3)
