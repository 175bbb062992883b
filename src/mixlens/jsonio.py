"""JSON from files a user gives (manifests, JSONL rows, saved analyses, configs): every way the text can be bad —
not UTF-8, not JSON, nested past Python's recursion limit, an integer past its digit limit, the wrong top-level
type — is one `MixlensError` naming the file (or line). A UTF-8 byte order mark is accepted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mixlens.errors import MixlensError

_KINDS: dict[type, str] = {dict: "a JSON object", list: "a JSON list"}


def loads(text: str | bytes, where: str, kind: type | None = dict) -> Any:
    """`json.loads(text)`, `kind` checked (None: any); `where` names the file or line in the messages."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise MixlensError(f"{where} is not UTF-8 text (bad byte at offset {e.start})") from None
    text = text.removeprefix("\ufeff")
    try:
        obj = json.loads(text)
    except RecursionError:
        raise MixlensError(f"{where} is not readable JSON: nested too deeply") from None
    except json.JSONDecodeError as e:
        at = f"line {e.lineno} column {e.colno}" if "\n" in text.strip() else f"column {e.colno}"
        raise MixlensError(f"{where} is not valid JSON ({e.msg} at {at})") from None
    except ValueError as e:  # e.g. an integer past Python's digit limit
        first = str(e).strip().splitlines()[0].split(";")[0] if str(e).strip() else type(e).__name__
        raise MixlensError(f"{where} is not readable JSON: {first}") from None
    if kind is not None and not isinstance(obj, kind):
        raise MixlensError(f"{where} is not {_KINDS.get(kind, kind.__name__)} (it holds a JSON {_json_type(obj)})")
    return obj


def read(path: str | Path, kind: type | None = dict) -> Any:
    """The JSON of the file `path` (see `loads`); an unreadable file is a `MixlensError` too."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise MixlensError(f"cannot read {path}: {e.strerror or e}") from None
    return loads(data, str(path), kind)


def _json_type(obj: object) -> str:
    if isinstance(obj, dict):
        return "object"
    if isinstance(obj, list):
        return "list"
    if isinstance(obj, str):
        return "string"
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "boolean"
    return "number"


def finite(obj: Any, path: str = "") -> tuple[Any, list[str]]:
    """`obj` with every NaN and ±inf float (also numpy floats) replaced by None — JSON has no NaN — and the paths
    (`metrics.saliency.spearman_gxi`, `examples[3].f`) where that happened. Dump the result with
    `json.dumps(..., allow_nan=False)`."""
    import math

    where: list[str] = []

    def walk(o: Any, at: str) -> Any:
        if isinstance(o, dict):
            return {k: walk(v, f"{at}.{k}" if at else str(k)) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v, f"{at}[{i}]") for i, v in enumerate(o)]
        if isinstance(o, float) or type(o).__name__ in ("float32", "float64", "float16"):
            if not math.isfinite(float(o)):
                where.append(at)
                return None
            return float(o)
        return o

    return walk(obj, path), where


def dumps_finite(obj: Any, **kwargs: Any) -> tuple[str, list[str]]:
    """`json.dumps` of `finite(obj)` (never NaN or Infinity in the text) and the paths that held one."""
    clean, where = finite(obj)
    return json.dumps(clean, allow_nan=False, **kwargs), where


def summarize_paths(where: list[str], limit: int = 4) -> str:
    """`where` from `finite` in one short phrase: the first few paths and how many more."""
    shown = ", ".join(where[:limit])
    return shown + (f" and {len(where) - limit} more" if len(where) > limit else "")
