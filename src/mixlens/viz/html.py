"""Self-contained interactive HTML report: token×token heatmap, bipartite link view and mixing-ratio curves.

Everything is inline (script, style, data as JSON); the page makes no network request — a Content-Security-Policy
`default-src 'none'` enforces it. Each render gets its own element id and its script defines no globals, so several
reports (or notebook outputs) can share one page.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import uuid
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from mixlens import catalog
from mixlens.result import Analysis, Attribution
from mixlens.viz.labels import token_text

ASSETS = Path(__file__).parent
MAX_VALUES = 4_000_000  # numbers embedded per report (≈ 25 MB of JSON at most)
NOTEBOOK_MAX_VALUES = 1_000_000  # notebooks keep outputs in the .ipynb file: smaller budget
MAX_TOKENS = 256  # tokens shown per input
MAX_LINKS = 3000  # lines drawn in the bipartite view
SIG_DIGITS = 4
PRECISION = f"values rounded to {SIG_DIGITS} significant digits"
NONFINITE = "#ff00ff"  # NaN and ±inf cells and tokens (magenta: in neither colour map)


@cache
def asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


@cache
def _cmaps() -> dict[str, list[str]]:
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    return {
        k: [to_hex(colormaps[c](t / 255)) for t in range(256)]
        for k, c in (("sequential", "viridis"), ("diverging", "RdBu_r"))
    }


def round_sig(x: np.ndarray, digits: int = SIG_DIGITS) -> np.ndarray:
    """Round to `digits` significant digits (non-finite → 0), so the JSON text stays short."""
    x = np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    with np.errstate(divide="ignore"):
        mag = np.floor(np.log10(np.abs(x)))
    e = (digits - 1 - np.where(np.isfinite(mag), mag, 0)).astype(int)
    up = 10.0 ** np.abs(e)  # exact powers of ten keep the printed decimals short
    return np.where(e >= 0, np.round(x * up) / up, np.round(x / up) * up)


def _flat(a: np.ndarray) -> list[float | str | None]:
    """Values rounded for the page; NaN becomes null and ±inf the strings "inf"/"-inf" (JSON holds neither), so the
    view can mark them instead of drawing them as 0."""
    x = np.asarray(a, dtype=np.float64).ravel()
    out: list[float | str | None] = round_sig(x).tolist()
    for k in np.flatnonzero(~np.isfinite(x)).tolist():
        out[k] = None if np.isnan(x[k]) else ("inf" if x[k] > 0 else "-inf")
    return out


def _lead(a: Attribution) -> tuple[int, ...]:
    """The sizes of the axes before the token axes, read from one input (never the padded `values`)."""
    return tuple(int(s) for s in a.input(0).shape[: len(a.dims) - 2])


def build_payload(
    result: Analysis | Attribution,
    *,
    head_maps: dict[str, Attribution] | None = None,
    title: str | None = None,
    max_values: int = MAX_VALUES,
    max_tokens: int = MAX_TOKENS,
    label: Callable[[Any], str] | None = None,
) -> dict:
    """The JSON the view renders: inputs (text, tokens, per-layer mixing ratios) and methods with their
    [*lead, target, source] maps per input, flattened. `head_maps` adds per-head maps for methods whose own
    values are head-summed (the head selector then offers both). Over `max_values` numbers, per-head maps are
    dropped first, then whole methods; over `max_tokens`, maps are cut; every cut is stated in `notes`. The notes
    also say what the per-token scores of methods with a target explain (`label` names a class / token id)."""
    if isinstance(result, Attribution):
        attrs, ratios, texts = {result.method: result}, None, [" ".join(t) for t in result.tokens]
        model, version, tokens = result.model, "", result.tokens
    else:
        attrs, texts, model, version, tokens = (
            result.attributions,
            result.texts,
            result.model,
            result.version,
            result.tokens,
        )
        ratios = {v: result.mixing_ratio(v) for v in result.ratios} or None  # None: no norm-engine method
    tokens = [[token_text(t) for t in toks] for toks in tokens]  # as text: ' keys', not 'Ġkeys'
    head_maps = head_maps or {}
    notes: list[str] = [] if (said := explains_note(attrs, label)) is None else [said]
    shown = [min(len(t), max_tokens) for t in tokens]
    for b, t in enumerate(tokens):
        if len(t) > max_tokens:
            notes.append(
                f"input {b + 1}: maps show the first {max_tokens} of {len(t)} tokens (mixing ratios use all tokens)"
            )
    inputs = [
        {
            "text": texts[b],
            "tokens": tokens[b][: shown[b]],
            "ratios": None if ratios is None else {v: _flat(r[b]) for v, r in ratios.items()},
        }
        for b in range(len(tokens))
    ]

    plans = []
    scores = []
    rowed = []
    for name, a in attrs.items():
        if a.dims[-1] == "source" and a.dims[-2:] != ("target", "source"):
            scores.append(_scores_entry(name, a, shown))
            continue
        if a.dims[-2:] == ("target", "source") and a.rows is not None:
            rowed.append((name, a))
            continue
        if a.dims[-2:] != ("target", "source"):
            notes.append(
                f"'{name}' has axes ({', '.join(a.dims)}), not a token × token map: not shown here "
                f"(`mixlens analyze --method {name} --format json` writes its values)"
            )
            continue
        lead = a.dims[:-2]
        per_head = a if "head" in lead else head_maps.get(name)
        if per_head is not None and per_head.dims[-2:] != ("target", "source"):
            per_head = None
        plans.append((name, a, per_head))
    cells = sum(n * n for n in shown)

    def size(a: Attribution) -> int:
        return int(np.prod([s for s, d in zip(_lead(a), a.dims, strict=False) if d != "head"])) * cells

    def n_heads(p: Attribution) -> int:
        return _lead(p)[p.dims.index("head")]

    base = sum(size(a) for _, a, _ in plans)
    heads = sum(size(p) * n_heads(p) for _, _, p in plans if p is not None)
    if plans and base + heads > max_values and heads:
        notes.append(
            f"per-head maps left out to keep the file small ({base + heads:,} values > {max_values:,}); "
            "choose fewer methods/inputs, or `mixlens plot --head H`"
        )
        plans = [(n, a, None) for n, a, _ in plans]
    methods, used, dropped = [], 0, []
    from mixlens.methods.rollout import DISPLAY_NOTE, display_rows

    scaled = [n for n, a, _ in plans if display_rows(n, np.ones((1, 1)))[1]]
    if scaled:
        notes.append(f"{', '.join(scaled)}: {DISPLAY_NOTE}")
    for name, a, per_head in plans:
        if used + size(a) > max_values:
            dropped.append(name)
            continue
        used += size(a) + (0 if per_head is None else size(per_head) * n_heads(per_head))
        methods.append(_method_entry(name, a, per_head, shown))
    for name, a in rowed:  # row mode (`analyze --rows`): each computed row as per-token scores
        rows = sum(
            int(np.prod([s for s, d in zip(a.input(b).shape, a.dims, strict=True) if d not in ("head", "source")])) * n
            for b, n in enumerate(shown)
        )
        if used + rows > max_values:
            dropped.append(name)
            continue
        used += rows
        scores.append(_rows_entry(name, a, shown, tokens))
        notes.append(f"'{name}' holds only target rows: each row is shown as per-token scores (below the view)")
    if dropped:
        notes.append(
            f"left out to keep the file small (over {max_values:,} values): {', '.join(dropped)}; "
            "choose them with --method"
        )
    names = [m["name"] for m in methods]
    start = next((names.index(m) for m in catalog.defaults("html") if m in names), 0)  # opens on a decomposition
    return {
        "title": title or "mixlens report",
        "start_method": start,
        "scores": scores,
        "model": model,
        "version": version,
        "precision": PRECISION,
        "notes": notes,
        "inputs": inputs,
        "methods": methods,
        "cmaps": _cmaps(),
        "max_links": MAX_LINKS,
        "nonfinite": NONFINITE,
    }


def explains_note(attrs: dict[str, Attribution], label: Callable[[Any], str] | None = None) -> str | None:
    """What the scores of the methods that take a target (their declared `target` option, read from the shipped
    catalog) explain, from the target and foil in their parameters: the prediction, or a named target, minus a
    foil; None when no method takes a target."""
    name = label or (lambda v: f"id {v}")
    takes = catalog.option_names()
    groups: dict[tuple[str, str | None], list[str]] = {}
    for m, a in attrs.items():
        if "target" in takes.get(m, ()):
            t, f = a.params.get("target", "pred"), a.params.get("foil")
            key = ("pred" if t == "pred" else name(t), None if f is None else name(f))
            groups.setdefault(key, []).append(m)
    if not groups:
        return None
    parts = [
        f"{', '.join(ms)}: "
        + ("the model's own prediction" if t == "pred" else f"target {t}")
        + ("" if f is None else f" minus foil {f} (the logit difference)")
        for (t, f), ms in groups.items()
    ]
    return "Per-token scores explain, at the prediction's position — " + "; ".join(parts)


def _method_entry(name: str, a: Attribution, per_head: Attribution | None, shown: list[int]) -> dict[str, Any]:
    lead = list(a.dims[:-2])
    own_head = "head" in lead
    axes = [{"name": d, "size": s} for d, s in zip(lead, _lead(a), strict=True) if d != "head"]
    values, head_values = [], []
    from mixlens.methods.rollout import display_rows

    for b, n in enumerate(shown):
        v = a.input(b)[..., :n, :n]  # [*lead, n, n]
        if own_head:
            v = v.mean(lead.index("head"))
        values.append(_flat(display_rows(name, v)[0]))  # unnormalised rollouts: rows scaled to sum to 1
        if per_head is not None:
            h = per_head.input(b)[..., :n, :n]
            head_values.append(_flat(np.moveaxis(h, per_head.dims.index("head"), -3)))  # [*lead, head, n, n]
    n_heads = 0 if per_head is None else _lead(per_head)[per_head.dims.index("head")]
    signed = any(_has_negative(a.input(b)) for b in range(len(shown)))
    return {
        "name": name,
        "axes": axes,
        "heads": n_heads,
        "all_label": "mean over heads" if own_head else "all heads",
        "signed": signed,
        "values": values,
        "head_values": head_values if per_head is not None else None,
    }


def _has_negative(v: np.ndarray) -> bool:
    """Whether a map holds a finite negative value (NaN and ±inf do not make a method signed)."""
    return bool(np.any(np.isfinite(v) & (v < 0)))


def _rows_entry(name: str, a: Attribution, shown: list[int], tokens: list[list[str]]) -> dict[str, Any]:
    """A map of target rows only ([*lead, K, source], `Attribution.rows`) as per-token score rows: one row per
    leading index (heads averaged) and computed target, labelled with its position and token."""
    assert a.rows is not None
    rows = []
    for b, n in enumerate(shown):
        v = a.input(b)[..., :n]
        lead = list(a.dims[:-2])
        if "head" in lead:
            v = v.mean(lead.index("head"))
            lead.remove("head")
        flat = v.reshape(-1, v.shape[-2], n)  # [lead..., K, n]
        for k, block in enumerate(flat):
            where = np.unravel_index(k, v.shape[:-2]) if lead else ()
            at = "".join(f", {d} {int(i)}" for d, i in zip(lead, where, strict=True))
            for r, pos in enumerate(a.rows[b]):
                label = f"input {b + 1}{at}, target {pos} \u201c{tokens[b][pos]}\u201d"
                rows.append({"label": label, "input": b, "values": _flat(block[r])})
    return {"name": name, "rows": rows}


def _scores_entry(name: str, a: Attribution, shown: list[int]) -> dict[str, Any]:
    """Per-token scores (dims [..., source]) of each input: one row per leading index (e.g. per class)."""
    rows = []
    for b, n in enumerate(shown):
        v = a.input(b)[..., :n]
        flat = v.reshape(-1, n)
        for k, r in enumerate(flat):
            label = f"input {b + 1}" + (f", {a.dims[0]} {k}" if v.ndim > 1 else "")
            rows.append({"label": label, "input": b, "values": _flat(r)})
    return {"name": name, "rows": rows}


def _scores_markup(payload: dict) -> str:
    """Highlighted text for per-token methods (saliency, decompx_classes, ...), rendered here as static HTML:
    each token's background follows its score / max |score| of the row (red +, blue −); the score is its title."""
    if not payload.get("scores"):
        return ""
    cmap = payload["cmaps"]["diverging"]
    parts = ['<div class="mlx-report mlx-scores"><h3>Per-token scores (highlighted text)</h3>']
    for entry in payload["scores"]:
        parts.append(f"<h4>{html.escape(entry['name'])}</h4>")
        for row in entry["rows"]:
            toks = payload["inputs"][row["input"]]["tokens"]
            lim = max((abs(x) for x in row["values"] if isinstance(x, float | int)), default=0.0) or 1.0
            spans = []
            for t, x in zip(toks, row["values"], strict=False):
                if not isinstance(x, float | int):  # NaN (null) or ±inf ("inf"/"-inf"): marked, never drawn as 0
                    spans.append(
                        f'<span class="mlx-nonfinite" title="{"nan" if x is None else x}" style="background:'
                        f"{NONFINITE};color:#fff;padding:1px 3px;margin:1px;border-radius:3px;display:inline-block;"
                        f'outline:1px dashed #000">{html.escape(t)}</span>'
                    )
                    continue
                colour = cmap[min(255, max(0, round(127.5 + 127.5 * x / lim)))]
                ink = "#fff" if abs(x) > 0.6 * lim else "#000"  # readable on the dark ends of the scale
                spans.append(
                    f'<span title="{x:.4g}" style="background:{colour};color:{ink};padding:1px 3px;margin:1px;'
                    f'border-radius:3px;display:inline-block">{html.escape(t)}</span>'
                )
            parts.append(f"<p><b>{html.escape(row['label'])}</b>: {''.join(spans)}</p>")
    parts.append("</div>\n")
    return "".join(parts)


def _json_for_script(payload: dict) -> str:
    """JSON safe inside a <script> element (no `</script>`, no HTML comment openers)."""
    return (
        json.dumps(payload, separators=(",", ":"), allow_nan=False)
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
    )


def _fragment(payload: dict) -> tuple[str, str]:
    """(markup, inline script) for one report view with a fresh unique id."""
    uid = f"mlx-{uuid.uuid4().hex[:12]}"
    script = (
        f"(function(){{\n{asset('report.js')}\nvar root=document.getElementById({json.dumps(uid)});\n"
        f"mlxMount(root, JSON.parse(document.getElementById({json.dumps(uid + '-data')}).textContent));\n}})();"
    )
    markup = (
        f'<div class="mlx-report" id="{uid}"><noscript>This mixlens report needs JavaScript.</noscript>'
        f"</div>\n<style>{asset('report.css')}</style>\n"
        f'<script type="application/json" id="{uid}-data">{_json_for_script(payload)}</script>\n'
        + _scores_markup(payload)
    )
    return markup, script


def render_fragment(result: Analysis | Attribution, **kwargs: Any) -> str:
    """An HTML fragment for notebooks (`_repr_html_`): unique ids, no globals, no network."""
    kwargs.setdefault("max_values", NOTEBOOK_MAX_VALUES)
    markup, script = _fragment(build_payload(result, **kwargs))
    return f"{markup}<script>{script}</script>\n"


def csp_hash(script: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()


def page(body: str, scripts: list[str], title: str, connect: bool = False) -> str:
    """A whole HTML document whose CSP allows only the given inline scripts (by hash), inline styles, data:
    images and — with `connect` — requests to its own origin."""
    csp = (
        f"default-src 'none'; script-src {' '.join(repr(csp_hash(s)) for s in scripts)}; "
        f"style-src 'unsafe-inline'; img-src data:{'; connect-src ' + repr('self') if connect else ''}; "
        "base-uri 'none'; form-action 'none'"
    )
    tags = "".join(f"<script>{s}</script>\n" for s in scripts)
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{html.escape(csp, quote=False)}">\n'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(title)}</title></head>\n<body>\n{body}{tags}</body></html>\n"
    )


def render_report(analysis: Analysis | Attribution, **kwargs: Any) -> str:
    """One self-contained HTML document for `analysis` (see `build_payload` for the keyword options)."""
    from mixlens.viz.routes import routes_markup
    from mixlens.viz.segments import render_html as segments_markup

    payload = build_payload(analysis, **kwargs)
    markup, script = _fragment(payload)
    markup += routes_markup(analysis)  # information-flow routes, when the analysis holds them, as PNG figures
    markup += segments_markup(analysis)  # an explanation's segments: ranked, and answer tokens × segments
    return page(markup, [script], f"{payload['title']} — {payload['model']}")
