"""Checking untrusted loaded data (a saved file's manifest and tensors, analyze's JSON) before any value is used:
every field, axis and array against the manifest and the tokens; a crafted or damaged file gives one `MixlensError`
line naming the file and the field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mixlens import catalog
from mixlens.errors import MixlensError
from mixlens.result.rows import TOKEN_AXES

if TYPE_CHECKING:
    from mixlens.result.attribution import Attribution
    from mixlens.result.rows import InputRows


MAX_LAYERS = 1024  # layers a saved file may hold (real models have at most a few hundred)


def is_int(x: object) -> bool:
    """True for an int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_rows(
    parts: list[tuple[np.ndarray, np.ndarray]],
    dims: tuple[str, ...],
    lengths: list[int],
    what: str,
    rows: list[int] | None = None,
) -> None:
    """Per-input rows from untrusted arrays (a loaded file), before they are stored (`InputRows.checked`): every input
    exactly once, float values with one row per input number, token axes as long as the block's longest input (the
    `target` axis of row mode: its inputs' most `rows`), other axes equal in every block."""
    seen = np.zeros(len(lengths), bool)
    sizes: dict[int, int] = {}
    for k, (i, a) in enumerate(parts):
        if i.ndim != 1 or i.dtype.kind not in "iu":
            raise MixlensError(f"{what}: block {k} has no list of input numbers")
        if a.dtype.kind != "f":
            raise MixlensError(f"{what}: block {k} holds {a.dtype}, not floating-point values")
        if a.ndim != len(dims) + 1 or len(a) != len(i):
            raise MixlensError(
                f"{what}: block {k} has shape {list(a.shape)}, expected {len(i)} rows of axes [{', '.join(dims)}]"
            )
        if len(i) == 0 or i.min() < 0 or i.max() >= len(lengths):
            raise MixlensError(f"{what}: block {k} names inputs outside 1..{len(lengths)}")
        if seen[i].any() or len(np.unique(i)) != len(i):
            raise MixlensError(f"{what}: an input appears in more than one row")
        seen[i] = True
        longest = max(lengths[b] for b in i.tolist())
        most_rows = longest if rows is None else max(rows[b] for b in i.tolist())  # row mode
        for ax, d in enumerate(dims):
            size = a.shape[ax + 1]
            if d == "target" and rows is not None:
                if size != most_rows:
                    raise MixlensError(f"{what}: block {k} has {size} target rows, its inputs have {most_rows}")
            elif d in TOKEN_AXES and size != longest:
                raise MixlensError(
                    f"{what}: block {k} has {size} '{d}' positions but its longest input has {longest} tokens"
                )
            if d not in TOKEN_AXES and sizes.setdefault(ax, size) != size:
                raise MixlensError(f"{what}: axis '{d}' has {size} entries in block {k}, {sizes[ax]} before")
    if not seen.all():
        raise MixlensError(f"{what}: input {int(np.argmin(seen)) + 1} has no values")


def checked_field(man: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path) -> Any:
    """The manifest field `key`, checked to be present and of type `kind` (a bool is not an int)."""
    if key not in man:
        raise MixlensError(f"{path}: missing field '{key}'")
    if not isinstance(man[key], kind) or isinstance(man[key], bool) and kind is not bool:
        raise MixlensError(f"{path}: field '{key}' has the wrong type ({type(man[key]).__name__})")
    return man[key]


def checked_tokens(man: dict[str, Any], path: Path) -> list[list[str]]:
    """The manifest's tokens: a non-empty list of non-empty lists of strings."""
    tokens = checked_field(man, "tokens", list, path)
    if not tokens or not all(isinstance(t, list) and t and all(isinstance(x, str) for x in t) for t in tokens):
        raise MixlensError(f"{path}: 'tokens' must be a non-empty list of non-empty token lists")
    return tokens


def checked_words(man: dict[str, Any], tokens: list[list[str]], path: Path) -> list[list[int | None]] | None:
    """The manifest's token → word indices (None where absent), one list per input as long as its tokens."""
    words = man.get("words")
    if words is None:
        return None
    if (
        not isinstance(words, list)
        or len(words) != len(tokens)
        or not all(
            isinstance(w, list) and len(w) == len(t) and all(x is None or is_int(x) for x in w)
            for w, t in zip(words, tokens, strict=False)
        )
    ):
        raise MixlensError(f"{path}: 'words' must give a word id (or null) for every token")
    return words


def checked_dims(value: object, path: Path, what: str) -> tuple[str, ...]:
    """`value` as axis names: a list of distinct strings (`what` names it in the error)."""
    if not isinstance(value, list) or not all(isinstance(d, str) for d in value) or len(set(value)) != len(value):
        raise MixlensError(f"{path}: {what} must be a list of distinct axis names")
    return tuple(value)


def checked_rows(man: dict[str, Any], tokens: list[list[str]], path: Path) -> list[list[int]] | None:
    """The row positions of row mode from a manifest, checked against the tokens (None: every row). Files of
    earlier versions name them 'targets'."""
    key = "rows" if "rows" in man else "targets"
    rows = man.get(key)
    if rows is None:
        return None
    if (
        not isinstance(rows, list)
        or len(rows) != len(tokens)
        or not all(
            isinstance(r, list) and all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < len(t) for p in r)
            for r, t in zip(rows, tokens, strict=True)
        )
    ):
        raise MixlensError(f"{path}: '{key}' must list, per input, token positions inside that input")
    return rows


def checked_answer(value: object, what: str) -> None:
    """An explained answer (`explain.answers.Answer.to_json`): its text, ids, tokens, first position and one
    finite log-probability (≤ 0) per token."""
    ok = isinstance(value, dict) and set(value) == {"text", "ids", "tokens", "start", "logprobs"}
    if ok:
        assert isinstance(value, dict)
        ids, toks, lps = value["ids"], value["tokens"], value["logprobs"]
        ok = (
            isinstance(value["text"], str)
            and is_int(value["start"])
            and value["start"] >= 1
            and isinstance(ids, list)
            and bool(ids)
            and all(is_int(i) and i >= 0 for i in ids)
            and isinstance(toks, list)
            and len(toks) == len(ids)
            and all(isinstance(x, str) for x in toks)
            and isinstance(lps, list)
            and len(lps) in (0, len(ids))
            and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 0 for x in lps
            )
        )
    if not ok:
        raise MixlensError(f"{what} must hold its text, ids, tokens, start and one log-probability per token")


EXPLAINED_KEYS = {"kind", "label", "score", "foil", "index", "foil_index", "probability", "foil_probability"} | {
    "answer",
    "phrase",
}


def checked_phrase(value: object, what: str) -> None:
    """An explained multi-token target (`explain.answers.Phrase.to_json`): the target phrase, the foil phrase or
    null (each as an answer), and per method the finite part on the phrases' own tokens."""
    if not isinstance(value, dict) or set(value) != {"target", "foil", "within"}:
        raise MixlensError(f"{what} must hold its target, foil and within")
    checked_answer(value["target"], f"{what}'s target")
    if value["foil"] is not None:
        checked_answer(value["foil"], f"{what}'s foil")
    within = value["within"]
    if not isinstance(within, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in within.values()
    ):
        raise MixlensError(f"{what}'s within must map methods to numbers")


def checked_explained(value: object, n: int, where: str) -> list[dict[str, Any]] | None:
    """Each input's explained target (`Explanation`), checked: None, or n objects with a string 'kind' and 'label',
    a number (or null) 'score', optionally a string 'foil' and the integer ids 'index' / 'foil_index'."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n:
        raise MixlensError(f"{where}: the explained targets must be one object per input")
    for b, t in enumerate(value):
        ok = (
            isinstance(t, dict)
            and isinstance(t.get("kind"), str)
            and isinstance(t.get("label"), str)
            and (
                t.get("score") is None or isinstance(t.get("score"), (int, float)) and not isinstance(t["score"], bool)
            )
            and isinstance(t.get("foil", ""), str)
            and all(type(t.get(k, 0)) is int for k in ("index", "foil_index"))
            and all(
                isinstance(t.get(k, 0.0), (int, float)) and not isinstance(t.get(k), bool)
                for k in ("probability", "foil_probability")
            )
            and set(t) <= EXPLAINED_KEYS
        )
        if not ok:
            raise MixlensError(f"{where}: input {b + 1}'s target must have a string kind and label and a number score")
        if "answer" in t:
            checked_answer(t["answer"], f"{where}: input {b + 1}'s answer")
        if "phrase" in t:
            checked_phrase(t["phrase"], f"{where}: input {b + 1}'s phrase")
        for k in ("probability", "foil_probability"):
            p = t.get(k)
            if p is not None and not 0 <= p <= 1:  # also NaN
                raise MixlensError(f"{where}: input {b + 1}'s target has {k} {p}, not in [0, 1]")
    return value


def checked_array(value: object, dims: tuple[str, ...], n: int, what: str, rows: int | None = None) -> np.ndarray:
    """Nested lists of numbers → a float32 array with one axis per name in `dims`, token axes of length n (the
    `target` axis of row mode: `rows`). Only numbers are accepted (not strings, booleans or null)."""
    if isinstance(value, (str, bytes)):
        raise MixlensError(f"{what}: values are not a regular array of numbers")
    try:
        a = np.asarray(value)
    except (TypeError, ValueError, RecursionError):
        raise MixlensError(f"{what}: values are not a regular array of numbers") from None
    if a.dtype.kind not in "iuf":  # strings, objects (ragged lists, null) and booleans
        raise MixlensError(f"{what}: values are not a regular array of numbers")
    with np.errstate(over="ignore"):  # a value past float32's range becomes ±inf, which the checks name
        a = a.astype(np.float32)
    if a.ndim != len(dims):
        raise MixlensError(f"{what}: values have {a.ndim} axes, the dims name {len(dims)}")
    for s, d in zip(a.shape, dims, strict=True):
        want = rows if d == "target" and rows is not None else n
        if d in TOKEN_AXES and s != want:
            raise MixlensError(
                f"{what}: axis '{d}' has {s} entries for {want} {'target rows' if want is rows else 'tokens'}"
            )
    return a


def check_layers(
    attributions: Mapping[str, Attribution], ratios: Mapping[str, InputRows], bias: InputRows | None, where: str
) -> None:
    """Every 'layer' axis of a loaded analysis (methods, extras, mixing ratios, bias) has the same length, at most
    `MAX_LAYERS`; each method's extras have the axes its registry entry declares; the flow routes' position is a
    token of its input."""
    found: dict[int, str] = {}
    stores = [(f"'{n}'", a.store) for n, a in attributions.items()]
    stores += [(f"'{n}.{k}'", e) for n, a in attributions.items() for k, e in a.extra_store.items()]
    stores += [(f"mixing ratio '{v}'", r) for v, r in ratios.items()] + ([("the bias", bias)] if bias else [])
    for what, st in stores:
        if "layer" in st.dims:
            for _, block in st.parts:
                found.setdefault(int(block.shape[1 + st.dims.index("layer")]), what)
    if len(found) > 1:
        (a, x), (b, y) = list(found.items())[:2]
        raise MixlensError(f"{where}: {x} has {a} layers but {y} has {b}")
    if found and max(found) > MAX_LAYERS:
        raise MixlensError(
            f"{where}: {found[max(found)]} has {max(found)} layers; a saved file holds at most {MAX_LAYERS}"
        )
    _check_extras(attributions, where)


def _check_extras(attributions: Mapping[str, Attribution], where: str) -> None:
    """The extras of a method the registry knows have the axes it declares (the shipped catalog: no torch), and an
    extra named `position` (the explained token, e.g. the flow routes') is an integer inside its input."""
    declared = {m["name"]: m["extras"] for m in catalog.load()}
    for name, a in attributions.items():
        for k, st in a.extra_store.items():
            want = declared.get(name, {}).get(k)
            if want is not None and a.dims == ("target", "source") and a.rows is not None:
                want = ["target", *want]  # an explained answer: one row per answer token (`explain(answer=)`)
            if want is not None and tuple(want) != st.dims:
                raise MixlensError(
                    f"{where}: extra '{name}.{k}' has the axes {list(st.dims)}; {name} writes {list(want)}"
                )
        if "position" in a.extra_store:
            st = a.extra_store["position"]
            for b, toks in enumerate(a.tokens):
                p = float(st.row(b))
                if not (p == int(p) if np.isfinite(p) else False) or not 0 <= p < len(toks):
                    raise MixlensError(
                        f"{where}: input {b + 1}: '{name}.position' is {p:g}, not a token position of its "
                        f"{len(toks)} tokens"
                    )


def checked_json_rows(m: dict[str, Any], dims: tuple[str, ...], n: int, what: str) -> list[int] | None:
    """The `rows` of one method `m` of one input in analyze's JSON (row mode; 'targets' in files of earlier
    versions): distinct integer positions inside the input's n tokens, for a method with a `target` axis; None
    when absent."""
    key = "rows" if "rows" in m else "targets"
    value = m.get(key)
    if value is None:
        return None
    if "target" not in dims:
        raise MixlensError(f"{what}: '{key}' given for a method without a 'target' axis")
    if (
        not isinstance(value, list)
        or not value
        or not all(is_int(p) and 0 <= p < n for p in value)
        or len(set(value)) != len(value)
    ):
        raise MixlensError(f"{what}: '{key}' must list distinct integer token positions inside the input ({n} tokens)")
    return value
