"""The terminal view (rich) of an `Attribution` (`Attribution.show`): shaded token × token tables and per-token
score bars."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mixlens.errors import MixlensError
from mixlens.viz.labels import token_text

if TYPE_CHECKING:
    from mixlens.result import Attribution

TOKEN_AXES = ("target", "source", "token")
BAR = 20  # characters of the longest score bar


def _pick(attr: Attribution, b: int, layer: int, head: int | None) -> tuple[np.ndarray, tuple[str, ...], list[str]]:
    """Input b's values with `layer` and `head` picked (head None: mean over heads) and any other leading axis but
    one kept: (array, its axes, what was picked)."""
    v, dims = attr.input(b), list(attr.dims)
    desc: list[str] = []
    for d in list(dims):
        if d in TOKEN_AXES:
            continue
        ax, size = dims.index(d), v.shape[dims.index(d)]
        if d == "layer":
            if not -size <= layer < size:
                raise MixlensError(f"layer {layer} out of range; '{attr.method}' has {size} layers (0..{size - 1})")
            v, desc = np.take(v, layer, ax), [*desc, f"layer {layer % size}"]
        elif d == "head":
            if head is None:
                v, desc = v.mean(ax), [*desc, "mean over heads"]
            elif not 0 <= head < size:
                raise MixlensError(f"head {head} out of range; '{attr.method}' has {size} heads (0..{size - 1})")
            else:
                v, desc = np.take(v, head, ax), [*desc, f"head {head}"]
        else:
            continue
        dims.remove(d)
    if head is not None and "head" not in attr.dims:
        raise MixlensError(f"'{attr.method}' has no per-head values")
    while v.ndim > 2 or (v.ndim == 2 and not any(d in TOKEN_AXES for d in dims)):
        desc.append(f"{dims[0]} 0")
        v, dims = v[0], dims[1:]
    return v, tuple(dims), desc


def _shade(x: float, top: float) -> str:
    """A background style: blue for positive, red for negative values, by |x| / top."""
    f = 0.0 if top <= 0 else min(1.0, abs(x) / top)
    strong, mid = int(255 - 200 * f), int(255 - 150 * f)
    r, g, bl = (strong, mid, 255) if x >= 0 else (255, mid, strong)
    return f"black on rgb({r},{g},{bl})"


def show_attribution(
    attr: Attribution,
    inputs: int | Sequence[int] | None = None,
    *,
    layer: int = -1,
    head: int | None = None,
    max_tokens: int = 16,
    console: Any = None,
) -> None:
    """Print `attr` for `inputs` (see `Attribution.show`)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    picks = range(len(attr)) if inputs is None else [inputs] if isinstance(inputs, int) else list(inputs)
    for b in picks:
        if not 0 <= b < len(attr):
            raise MixlensError(f"input {b} out of range; there are {len(attr)} inputs (0..{len(attr) - 1})")
        v, dims, desc = _pick(attr, b, layer, head)
        toks = [token_text(t) for t in attr.tokens[b]]
        title = f"{attr.method} — input {b + 1}" + (f" ({', '.join(desc)})" if desc else "")
        cut = len(toks) > max_tokens and any(d in TOKEN_AXES for d in dims)
        m = min(len(toks), max_tokens)
        if dims == ("target", "source"):
            v = v[:m, :m]
            top = float(np.abs(v).max()) if v.size else 0.0
            table = Table(title=title, title_justify="left", show_lines=False, pad_edge=False)
            table.add_column("target ↓ / source →", no_wrap=True)
            for t in toks[:m]:
                table.add_column(t, justify="right", no_wrap=True, max_width=8)
            for i in range(m):
                table.add_row(toks[i], *(f"[{_shade(x, top)}]{x:.2f}[/]" for x in v[i].tolist()))
        else:
            tok_ax = [k for k, d in enumerate(dims) if d in TOKEN_AXES]
            if not tok_ax:  # no token axis left: plain numbers
                table = Table(title=title, title_justify="left")
                for k in range(v.size):
                    table.add_column(f"{dims[0] if dims else 'value'} {k}" if dims else "value", justify="right")
                table.add_row(*(f"{x:.4g}" for x in np.atleast_1d(v).tolist()))
                console.print(table)
                continue
            cols = (v[None] if v.ndim == 1 else v if tok_ax[0] == 1 else v.T)[:, :m]  # [lead, token]
            lead = [d for d in dims if d not in TOKEN_AXES]
            top = float(np.abs(cols).max()) if cols.size else 0.0
            table = Table(title=title, title_justify="left")
            table.add_column("token", no_wrap=True)
            for k in range(len(cols)):
                table.add_column(f"{lead[0]} {k}" if lead else "score", justify="right")
            if len(cols) == 1:
                table.add_column("", no_wrap=True)
            for j in range(m):
                row = [f"[{_shade(x, top)}]{x:.4g}[/]" for x in cols[:, j].tolist()]
                if len(cols) == 1:
                    row.append(
                        ("█" if cols[0, j] >= 0 else "▒") * round(BAR * abs(float(cols[0, j])) / top) if top > 0 else ""
                    )
                table.add_row(toks[j], *row)
        console.print(table)
        if cut:
            console.print(f"(the first {max_tokens} of {len(toks)} tokens shown; raise max_tokens for more)")
