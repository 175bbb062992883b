"""The method catalog: what `mixlens methods` prints, without importing torch.

The registry (`mixlens.methods.registry`) is the one place a method is declared; importing it loads torch and every
method module (seconds). `build()` reads the registry into plain data — names, axes, options, extras, the declared
capabilities and display hints, with the families each method refuses and why — and `data/methods.json`, shipped with
the package, holds that data so the command answers at once. `python -m mixlens.catalog` rewrites the file; a test
fails whenever it differs from `build()`, so it cannot drift from the registry.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

PATH = Path(__file__).resolve().parent / "data" / "methods.json"
WIDTH = 99  # columns, so that the text fits a 100-column terminal
HEAD_WORDS = {
    None: None,
    "any": "the model head's target (a class, a token, or an encoder's pooled embedding)",
    "classifier": "a sequence classifier's head",
    "causal": "a causal language model's head",
}


def build() -> list[dict[str, Any]]:
    """The catalog, from the registry (imports torch and every method)."""
    from mixlens.adapters import FAMILIES
    from mixlens.methods import REGISTRY

    out = []
    for m in REGISTRY.values():
        refused = {f.name: m.supports(f) for f in FAMILIES if m.supports(f) is not None}
        out.append(
            {
                "name": m.name,
                "summary": m.summary,
                "dims": list(m.dims),
                "head_dims": list(m.head_dims) if m.head_dims else None,
                "options": [o.describe() for o in m.options],
                "extras": {k: list(v) for k, v in m.extras.items()},
                "head": m.head,
                "explains": m.explains,
                "target_rows": m.target_rows,
                "inputs_only": m.inputs_only,
                "slow": m.slow or m.extra_passes,
                "refuses": refused,
                "default_in": dict(m.default_in),
                "group": m.group,
            }
        )
    return out


def load() -> list[dict[str, Any]]:
    """The shipped catalog (no torch)."""
    return json.loads(PATH.read_text(encoding="utf-8"))


def defaults(view: str) -> list[str]:
    """The registry's `defaults(view)` from the shipped catalog (no torch): what the commands and views offer by
    default (a method registered at run time, outside the package, is a default of no view)."""
    found = [m for m in load() if view in m["default_in"]]
    if not found:
        raise ValueError(f"no method is a default of view {view!r}")
    return [m["name"] for m in sorted(found, key=lambda m: m["default_in"][view])]


def in_group(group: str) -> list[str]:
    """The registry's `in_group(group)` from the shipped catalog (no torch)."""
    return [m["name"] for m in load() if m["group"] == group]


def _wrap(text: str, indent: int) -> list[str]:
    pad = " " * indent
    return textwrap.wrap(text, WIDTH, initial_indent=pad, subsequent_indent=pad + "  ", break_on_hyphens=False)


def lines(catalog: list[dict[str, Any]]) -> list[str]:
    """The catalog as text lines of at most `WIDTH` columns."""
    out: list[str] = []
    for m in catalog:
        axes = f"[batch, {', '.join(m['dims'])}]"
        if m["head_dims"]:
            axes += f"; --heads: [batch, {', '.join(m['head_dims'])}]"
        out += _wrap(f"{m['name']}  {axes}", 0)
        out += _wrap(m["summary"], 4)
        traits = []
        if m["explains"]:
            traits.append("explains a prediction (explain, evaluate)")
        if m["target_rows"]:
            traits.append("computes target rows only (--targets)")
        traits.append("runs from the inputs" if m["inputs_only"] else "reads the traced forward pass")
        if m["slow"]:
            traits.append("extra passes: slow on long inputs")
        out += _wrap("; ".join(traits), 4)
        if HEAD_WORDS[m["head"]]:
            out += _wrap(f"reads {HEAD_WORDS[m['head']]}", 4)
        for fam, why in m["refuses"].items():
            out += _wrap(f"refuses {fam}: {why}", 4)
        for opt in m["options"]:
            out += _wrap(f"--option {m['name']}.{opt}", 4)
        for key, axes_ in m["extras"].items():
            out += _wrap(f"extra {key}: [batch{''.join(', ' + a for a in axes_)}]", 4)
        out.append("")
    return out[:-1]


if __name__ == "__main__":
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(json.dumps(build(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {PATH}")
