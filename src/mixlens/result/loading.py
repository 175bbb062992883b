"""`Analysis.load`'s two readers of untrusted data, each checking every field and array before building the
analysis: a saved analysis (manifest + safetensors file) and the JSON of `mixlens analyze` / `explain`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mixlens.errors import MixlensError
from mixlens.result import segmented
from mixlens.result.attribution import Attribution
from mixlens.result.files import check_save_id, read_tensors
from mixlens.result.rows import TOKEN_AXES, InputRows
from mixlens.result.validation import (
    check_layers,
    checked_array,
    checked_dims,
    checked_explained,
    checked_field,
    checked_json_rows,
    checked_tokens,
    checked_words,
)

if TYPE_CHECKING:
    from mixlens.result.analysis import Analysis


def from_saved(cls: type[Analysis], man: dict[str, Any], path: Path) -> Analysis:
    """A saved analysis from its manifest `man` (read from `path`) and the tensor file beside it."""
    tokens = checked_tokens(man, path)
    words = checked_words(man, tokens, path)
    texts = checked_field(man, "texts", list, path)
    if len(texts) != len(tokens) or not all(isinstance(t, str) for t in texts):
        raise MixlensError(f"{path}: 'texts' must hold one string per input")
    model, version = checked_field(man, "model", str, path), checked_field(man, "version", str, path)
    methods, ratio_man = checked_field(man, "methods", dict, path), checked_field(man, "ratios", dict, path)
    tensors, meta = read_tensors(path.with_suffix(".safetensors"))
    check_save_id(man, meta, path)
    lengths, what = [len(t) for t in tokens], str(path.with_suffix(".safetensors"))
    attributions = {}
    for name, m in methods.items():
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("params"), dict)
            or not isinstance(m.get("extras", {}), dict)
        ):
            raise MixlensError(f"{path}: method '{name}' has a malformed entry")
        dims = checked_dims(m.get("dims"), path, f"the axes of '{name}'")
        store = InputRows.from_tensors(tensors, f"method.{name}.", m.get("blocks"), dims, lengths, what)
        extras = {}
        for k, e in m.get("extras", {}).items():
            if not isinstance(e, dict):
                raise MixlensError(f"{path}: extra '{k}' of '{name}' has a malformed entry")
            extras[k] = InputRows.from_tensors(
                tensors,
                f"extra.{name}.{k}.",
                e.get("blocks"),
                checked_dims(e.get("dims"), path, f"the axes of '{name}.{k}'"),
                lengths,
                what,
            )
        attributions[name] = Attribution(store, dims, tokens, name, model, m["params"], words, extras)
    ratios = {
        v: InputRows.from_tensors(tensors, f"ratio.{v}.", k, ("layer", "target"), lengths, what)
        for v, k in ratio_man.items()
    }
    bias = (
        None
        if man.get("bias") is None
        else InputRows.from_tensors(tensors, "bias.", man["bias"], ("layer", "target", "hidden"), lengths, what)
    )
    check_layers(attributions, ratios, bias, str(path))
    err = None
    if man.get("reconstruction_error"):
        err = tensors.get("reconstruction_error")
        if err is None or err.shape != (len(tokens),) or err.dtype.kind != "f":
            raise MixlensError(f"{what}: 'reconstruction_error' must hold one number per input")
    explained = checked_explained(man.get("explained"), len(tokens), str(path))
    res = cls(
        model,
        version,
        texts,
        tokens,
        attributions,
        ratios,
        err,
        bias,
        bool(man.get("ratio_means_only", False)),
        explained,
    )
    segs = man.get("segments")
    if segs is not None and (not isinstance(segs, list) or len(segs) != len(tokens)):
        raise MixlensError(f"{path}: 'segments' must hold one object per input")
    return segmented.attach(res, segs, str(path))


def from_json(cls: type[Analysis], obj: object, where: str = "the JSON") -> Analysis:
    """Rebuild an analysis from `to_json()`'s output (the JSON of `mixlens analyze`), checking its structure."""
    if not isinstance(obj, dict) or not isinstance(obj.get("inputs"), list) or not obj["inputs"]:
        raise MixlensError(f"{where}: expected an object with a non-empty 'inputs' list")
    model, version = obj.get("model", ""), obj.get("version", "")
    if not isinstance(model, str) or not isinstance(version, str):
        raise MixlensError(f"{where}: 'model' and 'version' must be strings")
    texts, tokens, errors = [], [], []
    values: dict[str, list[np.ndarray]] = {}
    extras: dict[str, dict[str, list[np.ndarray]]] = {}
    dims: dict[str, tuple[str, ...]] = {}
    extra_dims: dict[tuple[str, str], tuple[str, ...]] = {}
    means: dict[str, list[np.ndarray]] = {}
    rows: dict[str, list[list[int] | None]] = {}  # row mode (`analyze --rows`): positions per input
    explained: list[Any] = []  # `explain`'s JSON: each input's target
    for b, inp in enumerate(obj["inputs"]):
        at = f"{where}: input {b + 1}"
        if not isinstance(inp, dict) or not isinstance(inp.get("text"), str):
            raise MixlensError(f"{at} is not an object with a 'text'")
        toks = inp.get("tokens")
        if not isinstance(toks, list) or not toks or not all(isinstance(t, str) for t in toks):
            raise MixlensError(f"{at}: 'tokens' must be a non-empty list of strings")
        texts.append(inp["text"])
        tokens.append(toks)
        explained.append(inp.get("target"))
        meth, ratio = inp.get("methods"), inp.get("mixing_ratio", {})
        if not isinstance(meth, dict) or not isinstance(ratio, dict):
            raise MixlensError(f"{at}: 'methods' and 'mixing_ratio' must be objects")
        if b and (set(meth) != set(values) or set(ratio) != set(means)):
            raise MixlensError(f"{at} has other methods or ratio variants than input 1")
        for name, m in meth.items():
            if not isinstance(m, dict):
                raise MixlensError(f"{at}: method '{name}' is not an object")
            d = checked_dims(m.get("dims"), Path(where), f"the axes of '{name}'")
            if dims.setdefault(name, d) != d:
                raise MixlensError(f"{at}: '{name}' has other axes than in input 1")
            pos = checked_json_rows(m, d, len(toks), f"{at}: '{name}'")
            if b and (pos is None) != (rows[name][0] is None):
                raise MixlensError(f"{at}: '{name}' gives target rows for some inputs only")
            rows.setdefault(name, []).append(pos)
            values.setdefault(name, []).append(
                checked_array(m.get("values"), d, len(toks), f"{at}: '{name}'", None if pos is None else len(pos))
            )
            ex = m.get("extras", {})
            if not isinstance(ex, dict) or (b and set(ex) != set(extras.get(name, {}))):
                raise MixlensError(f"{at}: the extras of '{name}' differ from input 1 or are malformed")
            for k, e in ex.items():
                if not isinstance(e, dict):
                    raise MixlensError(f"{at}: extra '{name}.{k}' is not an object")
                ed = checked_dims(e.get("dims"), Path(where), f"the axes of '{name}.{k}'")
                if extra_dims.setdefault((name, k), ed) != ed:
                    raise MixlensError(f"{at}: extra '{name}.{k}' has other axes than in input 1")
                extras.setdefault(name, {}).setdefault(k, []).append(
                    checked_array(
                        e.get("values"), ed, len(toks), f"{at}: '{name}.{k}'", None if pos is None else len(pos)
                    )
                )
        for v, r in ratio.items():
            means.setdefault(v, []).append(checked_array(r, ("layer",), len(toks), f"{at}: mixing ratio '{v}'"))
        err = inp.get("reconstruction_error")
        if not (err is None or isinstance(err, (int, float)) and not isinstance(err, bool)):
            raise MixlensError(f"{at}: 'reconstruction_error' must be a number or null")
        errors.append(err)
    for name, arrs in {**values, **{f"mixing ratio '{v}'": m for v, m in means.items()}}.items():
        fixed = {
            tuple(s for s, d in zip(a.shape, dims.get(name, ("layer",)), strict=True) if d not in TOKEN_AXES)
            for a in arrs
        }
        if len(fixed) > 1:
            raise MixlensError(f"{where}: {name} has different non-token axis sizes across inputs")
    if len({e is None for e in errors}) > 1:
        raise MixlensError(f"{where}: 'reconstruction_error' is given for some inputs only")
    if any(isinstance(e, float) and not math.isfinite(e) for e in errors):
        raise MixlensError(f"{where}: 'reconstruction_error' must be a finite number")
    layers = {len(m[0]) for m in means.values()} | {
        arrs[0].shape[dims[name].index("layer")] for name, arrs in values.items() if "layer" in dims[name]
    }
    if len(layers) > 1:
        raise MixlensError(f"{where}: the mixing ratios and the methods give different layer counts ({sorted(layers)})")
    lengths = [len(t) for t in tokens]

    def store(arrs: list[np.ndarray], d: tuple[str, ...]) -> InputRows:
        return InputRows([(np.array([b]), a[None]) for b, a in enumerate(arrs)], d, lengths)

    attributions = {
        name: Attribution(
            store(arrs, dims[name]),
            dims[name],
            tokens,
            name,
            model,
            {},
            None,
            {k: store(e, extra_dims[(name, k)]) for k, e in extras.get(name, {}).items()},
            None if rows[name][0] is None else [r or [] for r in rows[name]],
        )
        for name, arrs in values.items()
    }
    # Each input's per-layer mean on every token, as read-only broadcast views: nothing is allocated per token
    # (a crafted file may declare many tokens and layers), and the means themselves are kept exact.
    ratios = {
        v: store(
            [np.broadcast_to(m[:, None], (len(m), n)) for m, n in zip(ms, lengths, strict=True)],
            ("layer", "target"),
        )
        for v, ms in means.items()
    }
    check_layers(attributions, ratios, None, where)
    err_arr = None if errors[0] is None else np.asarray(errors, np.float32)
    targets = None if all(t is None for t in explained) else checked_explained(explained, len(tokens), where)
    res = cls(model, version, texts, tokens, attributions, ratios, err_arr, None, True, targets)
    res._ratio_means = {v: np.stack(ms) for v, ms in means.items()}
    return segmented.attach(res, [inp.get("segments") for inp in obj["inputs"]], where, scores=True)
