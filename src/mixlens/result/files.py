"""Result files: a safetensors file (the per-batch blocks, no pickles) plus a JSON manifest beside it, both written
atomically (`mixlens.atomic.atomic_write`) and tied by a random save id.

Reading: `read_tensors` checks a safetensors header (its length, every tensor's dtype, shape and data range) before
the library parses it; the fields and arrays are then checked against the manifest and the tokens
(`mixlens.result.validation`), so a crafted or damaged file gives one `MixlensError` line.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from mixlens.atomic import atomic_write
from mixlens.errors import MixlensError
from mixlens.result.validation import is_int

ATTRIBUTION_FORMAT = "mixlens.attribution"
ANALYSIS_FORMAT = "mixlens.analysis"
SAVE_ID = "mixlens_save_id"  # safetensors metadata key; the manifest's "save_id" must match it
MAX_HEADER = 100 << 20  # bytes of safetensors JSON header accepted
_DTYPES = {"F16": 2, "F32": 4, "F64": 8, "I32": 4, "I64": 8}  # safetensors dtypes we read, with their sizes


def read_manifest(path: Path) -> dict[str, Any]:
    """The JSON manifest at `path` (`MixlensError` when it cannot be read)."""
    from mixlens import jsonio

    return jsonio.read(path)


def read_tensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a safetensors file whose header is checked first: its length within the file, every
    tensor a known dtype with a shape whose byte size is exactly its data range inside the file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise MixlensError(f"cannot read {path}: {e.strerror or e}") from None
    what = f"{path} is not a valid safetensors file"
    if len(data) < 8:
        raise MixlensError(f"{what}: {len(data)} bytes")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8 or n > MAX_HEADER:
        raise MixlensError(f"{what}: its header length {n} exceeds the file ({len(data)} bytes)")
    from mixlens import jsonio

    try:
        header = jsonio.loads(data[8 : 8 + n], "the header")
    except MixlensError as e:
        raise MixlensError(f"{what}: {e}") from None
    body = len(data) - 8 - n
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise MixlensError(f"{what}: bad metadata")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = (
            isinstance(info, dict)
            and info.get("dtype") in _DTYPES
            and isinstance(info.get("shape"), list)
            and all(is_int(x) and x >= 0 for x in info["shape"])
            and isinstance(info.get("data_offsets"), list)
            and len(info["data_offsets"]) == 2
            and all(is_int(x) for x in info["data_offsets"])
        )
        if not ok:
            raise MixlensError(f"{what}: tensor '{name}' has a malformed entry")
        start, stop = info["data_offsets"]
        need = math.prod(info["shape"]) * _DTYPES[info["dtype"]]
        if not 0 <= start <= stop <= body or stop - start != need:
            raise MixlensError(
                f"{what}: tensor '{name}' of shape {info['shape']} needs {need} bytes, its data "
                f"range is [{start}, {stop}) of {body}"
            )
    from safetensors.numpy import load

    try:
        tensors = load(data)
    except Exception as e:  # the library's own checks (overlaps, ...); its error types are not stable
        raise MixlensError(f"{what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return tensors, meta


def check_save_id(man: dict[str, Any], meta: dict[str, str], path: Path) -> None:
    """Refuse a manifest and tensor file whose save ids differ (written by different saves)."""
    if man.get("save_id") != meta.get(SAVE_ID):
        raise MixlensError(f"{path}: the manifest and the tensor file come from different saves")


def json_default(x: object) -> str:
    """Option values JSON cannot hold (a Python callable target) are recorded by name."""
    return f"<{getattr(x, '__qualname__', type(x).__name__)}>"


def write_store(path: Path, tensors: dict[str, np.ndarray], manifest: dict[str, Any]) -> None:
    """The tensor file, then the manifest (the commit point), both atomically, tied by a fresh save id."""
    from safetensors.numpy import save

    save_id = uuid.uuid4().hex
    atomic_write(path.with_suffix(".safetensors"), save(tensors, metadata={SAVE_ID: save_id}))
    atomic_write(path.with_suffix(".json"), json.dumps({**manifest, "save_id": save_id}, default=json_default).encode())
