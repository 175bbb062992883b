"""`mixlens analyze`'s terminal output (`--format table`): the mixing-ratio table of the norm family, each token's top
sources for token × token maps, the tokens with their scores for per-token methods."""

from __future__ import annotations

from typing import Any

from mixlens import catalog
from mixlens.viz.labels import token_text
from mixlens.viz.terminal.tables import print_table

TOP_SOURCES = 3  # sources listed per token for map methods


def describe(attr: Any) -> str:
    """What an `Attribution` holds, in words (for the 'wrote …' line)."""
    dims = attr.dims
    if dims[-2:] == ("target", "source"):
        per = [f"per {d}" for d in dims[:-2]]
        return " ".join(["token × token maps", *per])
    if dims[-1] == "source":
        return "a score per " + " and ".join([*dims[:-1], "token"])
    return "values over " + ", ".join(dims)


def print_results(res: Any, methods: list[str], dtype: str = "float32") -> None:
    """Per requested method what a reader can use: the mixing-ratio table for the norm family, each token's top
    sources at the last layer for token × token maps, the tokens with their scores for per-token methods."""
    from rich.console import Console

    console = Console()
    if any(m in catalog.in_group("mixing-ratio") for m in methods):  # the methods the mixing-ratio table describes
        print_ratios(res, dtype)
    for m in methods:
        attr = res[m]
        if attr.dims[-2:] == ("target", "source"):
            print_top_sources(attr)
        elif attr.dims[-1] == "source":
            print_scores(attr, console)
        else:
            console.print(f"{m}: {describe(attr)} (see the JSON)")


def _last_layer_map(attr: Any, b: int) -> tuple[Any, str]:
    """Input b's [target, source] map: last layer, mean over heads, index 0 of any other leading axis."""
    v = attr.input(b)
    where: list[str] = []
    for d in attr.dims[:-2]:
        if d == "layer":
            where.append(f"layer {v.shape[0] - 1}")
            v = v[-1]
        elif d == "head":
            where.append("mean over heads")
            v = v.mean(0)
        else:
            v = v[0]
    return v, ", ".join(where)


def print_top_sources(attr: Any) -> None:
    """For each token of each input (or each computed row, with --rows), its strongest sources (by
    |value|) in the method's last-layer map."""
    import numpy as np

    from mixlens.methods.rollout import DISPLAY_NOTE, display_rows

    for b, raw in enumerate(attr.tokens):
        toks = [token_text(t) for t in raw]
        m, where = _last_layer_map(attr, b)
        m, scaled = display_rows(attr.method, m)
        targets = list(range(len(toks))) if attr.rows is None else attr.rows[b]
        rows = []
        for i, pos in enumerate(targets):  # row i of the map is token `pos`
            order = np.argsort(-np.abs(m[i]), kind="stable")[:TOP_SOURCES]
            label = toks[pos] if attr.rows is None else f"{pos}: {toks[pos]}"
            rows.append([label, "  ".join(f"{toks[j]} {m[i, j]:.2f}" for j in order)])
        what = f"{attr.method}: top {TOP_SOURCES} sources of " + (
            "each token" if attr.rows is None else f"target row{'s' if len(targets) > 1 else ''} {_positions(targets)}"
        )
        what += f" ({where})" if where else ""
        print_table(what + (f" — input {b + 1}" if len(attr.tokens) > 1 else ""), ["token", "sources"], rows, left=(1,))
        if scaled and b == len(attr.tokens) - 1:
            print(f"note: {attr.method}: {DISPLAY_NOTE}")


def _positions(targets: list[int]) -> str:
    return ", ".join(map(str, targets)) if len(targets) <= 8 else f"{', '.join(map(str, targets[:8]))}, …"


def print_scores(attr: Any, console: Any) -> None:
    """The tokens of each input with their scores; the strongest |score| tokens highlighted (red +, blue −)."""
    import numpy as np
    from rich.text import Text

    for b, raw in enumerate(attr.tokens):
        toks = [token_text(t) for t in raw]
        v = attr.input(b)  # [*lead, n]
        rows = v.reshape(-1, v.shape[-1])
        labels = [""] if v.ndim == 1 else [f"{attr.dims[0]} {k}: " for k in range(rows.shape[0])]
        console.print(f"{attr.method}" + (f" — input {b + 1}" if len(attr.tokens) > 1 else "") + ":")
        for label, r in zip(labels, rows, strict=True):
            top = set(np.argsort(-np.abs(r), kind="stable")[:TOP_SOURCES].tolist())
            line = Text("  " + label)
            for j, t in enumerate(toks):
                style = ("bold white on red" if r[j] >= 0 else "bold white on blue") if j in top else ""
                line.append(f"{t}", style=style)
                line.append(f" {r[j]:.3g}  ", style="dim")
            console.print(line)


def print_ratios(res: Any, dtype: str = "float32") -> None:
    """The mean mixing ratio per layer of each variant of an `Analysis`, as a table that fits the terminal, and
    the reconstruction error as a share of the exactness check's tolerance for the run's `dtype`."""

    if not res.ratios:  # no requested method used the norm engine
        return
    means = {v: res.mixing_ratio(v).mean(0) for v in res.ratios}
    rows = [[str(layer), *(f"{100 * means[v][layer]:.1f}" for v in means)] for layer in range(len(means["W"]))]
    rows.append(["mean", *(f"{100 * means[v].mean():.1f}" for v in means)])
    print_table(f"Context-mixing ratio (%), mean over tokens and inputs — {res.model}", ["layer", *means], rows)
    print(error_line(float(res.reconstruction_error.max()), res.error_share, dtype))


def error_line(error: float, share: Any, dtype: str) -> str:
    """'reconstruction error: max abs 5.4e+01 = 0.3× the bfloat16 tolerance (...)': the check's tolerance is relative
    to each token's own size (`mixlens.methods.engine.TOLERANCES`), so the bare number means little alone."""
    from mixlens.methods.engine import TOLERANCES

    rel = {str(k).removeprefix("torch."): v for k, v in TOLERANCES.items()}.get(dtype)
    line = f"reconstruction error: max abs {error:.2g}"
    if share is None or rel is None:
        return line
    return (  # two lines that fit 80 columns
        f"{line} = {float(share.max()):.2g}× the {dtype} tolerance\n"
        f"  (every piece vs the model's own, per token, to {rel:g} of its size)"
    )
