"""The method and family catalogs: what `mixlens methods` and `mixlens families` print, without importing torch.

The registry (`mixlens.methods.registry`) is the one place a method is declared; importing it loads torch and every
method module (seconds). `build()` reads the registry into plain data — names, axes, options, extras, the declared
capabilities and display hints, with the families each method refuses and why — and `data/methods.json`, shipped with
the package, holds that data so the command answers at once. `data/families.json` (`build_families()`) holds the
adapter table (`mixlens.adapters.FAMILIES`) the same way: each family's model types, layout and the methods it runs
or refuses. `python -m mixlens.catalog` rewrites both files; a test fails whenever one differs from its build, so
neither can drift from the registry or the table.
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
                "row_mode": m.row_mode,
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


def option_names() -> dict[str, set[str]]:
    """Each method's option names, from the shipped catalog (no torch): e.g. which methods take a `target`."""
    return {m["name"]: {o.split(":")[0] for o in m["options"]} for m in load()}


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
        if m["row_mode"]:
            traits.append("computes requested rows only (--rows)")
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


FAMILIES_PATH = PATH.parent / "families.json"
# A Family's flags in words, (set, unset) (a flag without an entry is shown by its field name when set).
TRAIT_WORDS: dict[str, tuple[str | None, str | None]] = {
    "pre_ln": ("pre-LN blocks", "post-LN blocks"),
    "rms": ("RMSNorm", "LayerNorm"),
    "causal": ("causal decoder", "encoder"),
    "fused_qkv": ("fused q | k | v projection", None),
    "fused_gate_up": ("fused gate | up projection", None),
    "norm_offset": ("norms scale by (1 + w)", None),
    "multipliers": ("residual-branch and logit multipliers", None),
    "moe": ("mixture-of-experts FFN", None),
    "ln_mix_unit": ("no norm after the attention residual sum", None),
    "inplace_attention": (None, None),
}
PATH_WORDS = {  # optional module paths whose presence is a layout trait
    "ffn_gate": "gated FFN",
    "ln_post": "norm on each branch's output before the residual sum",
    "probs": "attention probabilities read from a module",
}


def traits(family: Any) -> list[str]:
    """A family's layout in words, from its declaration (`mixlens.adapters.Family`)."""
    import dataclasses

    out = []
    for f in dataclasses.fields(family):
        value = getattr(family, f.name)
        word: str | None
        if f.name == "pre_ln" and value and family.ln_in is None:
            word = "no norm before a branch"  # OLMo 2: x + g(Attn(x)), norms after the branches
        elif isinstance(value, bool):
            on, off = TRAIT_WORDS.get(f.name, (f.name.replace("_", " "), None))
            word = on if value else off
        elif f.name in PATH_WORDS:
            word = PATH_WORDS[f.name] if value else None
        else:
            continue
        if word:
            out.append(word)
    return out


def build_families() -> list[dict[str, Any]]:
    """Every family of the adapter table with its model types, layout and what each method does on it (imports
    torch and every method)."""
    from mixlens.adapters import FAMILIES
    from mixlens.methods import REGISTRY

    return [
        {
            "name": fam.name,
            "model_types": list(fam.model_types),
            "traits": traits(fam),
            "runs": [m.name for m in REGISTRY.values() if m.supports(fam) is None],
            "refuses": {m.name: why for m in REGISTRY.values() if (why := m.supports(fam)) is not None},
        }
        for fam in FAMILIES
    ]


def load_families() -> list[dict[str, Any]]:
    """The shipped family catalog (no torch)."""
    return json.loads(FAMILIES_PATH.read_text(encoding="utf-8"))


def family_lines(catalog: list[dict[str, Any]]) -> list[str]:
    """The family catalog as text lines of at most `WIDTH` columns; refusals with the same reason are grouped."""
    out: list[str] = []
    for fam in catalog:
        out += _wrap(f"{fam['name']}  model types: {', '.join(fam['model_types'])}", 0)
        out += _wrap(f"layout: {', '.join(fam['traits'])}", 4)
        total = len(fam["runs"]) + len(fam["refuses"])
        if not fam["refuses"]:
            out += _wrap(f"runs all {total} methods", 4)
        else:
            out += _wrap(f"runs {len(fam['runs'])} of {total} methods; refuses:", 4)
            grouped: dict[str, list[str]] = {}
            for name, why in fam["refuses"].items():
                grouped.setdefault(why, []).append(name)
            for why, names in grouped.items():
                out += _wrap(f"{', '.join(names)}: {why}", 6)
        out.append("")
    return out[:-1]


if __name__ == "__main__":
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(json.dumps(build(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    FAMILIES_PATH.write_text(json.dumps(build_families(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {PATH} and {FAMILIES_PATH}")
