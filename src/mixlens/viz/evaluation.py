"""Publication figure of `mixlens evaluate`: deletion curves with 95 % intervals, and the AOPC ranking."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def model_label(model: str) -> str:
    """A model for a figure title: a local path or hub id by its last part (the folder, not the whole path)."""
    return Path(str(model).rstrip("/")).name or str(model)


def plot(ev, path: str | Path, dpi: int = 200) -> None:
    """Left: mean f(x without top-K %) vs K per method (bands: bootstrap 95 %). Right: AOPC per method, ranked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    ci = np.array([met[m]["ci95"]["aopc"] for m in ranked])
    y = np.arange(len(ranked))[::-1]
    bx.barh(
        y,
        aopc,
        xerr=np.abs(ci.T - aopc),
        color=[("0.6" if m == "random" else colours[k]) for k, m in enumerate(ranked)],
        capsize=2,
    )
    bx.set_yticks(y, ranked, fontsize=8)
    bx.set_xlabel("AOPC (higher = more faithful)")
    bx.set_title("Ranking")
    bx.grid(axis="x", alpha=0.3)
    fig.suptitle(model_label(ev.model), fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), dpi=dpi)
    plt.close(fig)
