"""Result objects: `Attribution` (one method, labelled array) and `Analysis` (one `analyze` call), and their files.

Files are a safetensors file (the per-batch blocks, no pickles) plus a JSON manifest beside it, both written
atomically and tied by a random save id. Loading checks every field and every tensor header against the manifest
and the tokens before any value is used: a crafted or damaged file gives one `MixlensError` line.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mixlens.errors import MixlensError

WRITTEN: list[Path] = []  # files `atomic_write` completed in this process (the CLI's Ctrl-C line names them)


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write to a temp file beside `path`, fsync and close it, then rename: a crash never leaves a half file. A
    directory at `path` or a failing filesystem (read-only, full, no permission; a failed write, fsync or close) is a
    `MixlensError` naming the path, and the temp file is removed."""
    path = Path(path)
    if path.is_dir():
        raise MixlensError(f"cannot write '{path}': it is a directory; give a file name")
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:  # write, flush and fsync: a full disk fails here, not silently later
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the user's usual mode
        os.replace(tmp, path)
        WRITTEN.append(path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise MixlensError(f"cannot write '{path}': {e.strerror or e}") from None
        raise


TOKEN_AXES = ("target", "source", "token")
ATTRIBUTION_FORMAT = "mixlens.attribution"
ANALYSIS_FORMAT = "mixlens.analysis"
SAVE_ID = "mixlens_save_id"  # safetensors metadata key; the manifest's "save_id" must match it
MAX_HEADER = 100 << 20  # bytes of safetensors JSON header accepted
_DTYPES = {"F16": 2, "F32": 4, "F64": 8, "I32": 4, "I64": 8}  # safetensors dtypes we read, with their sizes


class Blocks:
    """Per-input rows stored per batch: block k holds the inputs `parts[k][0]` (original input numbers) as an array
    [rows, *dims] whose token axes are padded only to the longest input of that block, so memory follows the work,
    not the longest input of the whole call. `lengths[b]` is the number of real tokens of input b."""

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray]], dims: tuple[str, ...], lengths: list[int]):
        self.parts = [(np.asarray(i, dtype=np.int64), a) for i, a in parts]
        self.dims = tuple(dims)
        self.lengths = list(lengths)
        self._where = np.zeros((len(self.lengths), 2), np.int64)  # input → (block, row)
        for k, (idx, a) in enumerate(self.parts):
            if a.ndim != len(self.dims) + 1 or len(a) != len(idx):
                raise ValueError(f"block {k}: shape {a.shape} does not fit {len(idx)} rows of axes {self.dims}")
            self._where[idx, 0], self._where[idx, 1] = k, np.arange(len(idx))
        self._full: np.ndarray | None = None

    @classmethod
    def of(cls, values: np.ndarray, dims: tuple[str, ...], lengths: list[int]) -> Blocks:
        """One block holding every input (an already padded [batch, *dims] array)."""
        return cls([(np.arange(len(values)), values)], dims, lengths)

    @classmethod
    def checked(
        cls,
        parts: list[tuple[np.ndarray, np.ndarray]],
        dims: tuple[str, ...],
        lengths: list[int],
        what: str,
        rows: list[int] | None = None,
    ) -> Blocks:
        """Blocks from untrusted arrays (a loaded file): every input exactly once, float values with one row per
        input number, token axes as long as the block's longest input, other axes equal in every block."""
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
            most_rows = longest if rows is None else max(rows[b] for b in i.tolist())  # target-row mode
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
        return cls(parts, dims, lengths)

    @classmethod
    def concat(cls, stores: Sequence[Blocks], lengths: list[int]) -> Blocks:
        """The blocks of several stores one after the other (input numbers shifted)."""
        parts, offset = [], 0
        for s in stores:
            parts += [(i + offset, a) for i, a in s.parts]
            offset += len(s.lengths)
        return cls(parts, stores[0].dims, lengths)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self.parts)

    def row(self, b: int) -> np.ndarray:
        """Input b without padding: axes `dims` (a view)."""
        k, r = self._where[b]
        n = self.lengths[b]
        return self.parts[k][1][r][tuple(slice(0, n) if d in TOKEN_AXES else slice(None) for d in self.dims)]

    def full(self) -> np.ndarray:
        """All inputs as one [batch, *dims] array, token axes zero-padded to the longest input (built once)."""
        if self._full is None:
            if len(self.parts) == 1 and np.array_equal(self.parts[0][0], np.arange(len(self.lengths))):
                self._full = self.parts[0][1]
            else:
                shape = [max(a.shape[k + 1] for _, a in self.parts) for k in range(len(self.dims))]
                out = np.zeros((len(self.lengths), *shape), self.parts[0][1].dtype)
                for idx, a in self.parts:
                    at: tuple[np.ndarray | slice, ...] = (idx, *(slice(0, s) for s in a.shape[1:]))
                    out[at] = a
                self._full = out
        return self._full

    def map(self, fn: Callable[[np.ndarray], np.ndarray], dims: tuple[str, ...]) -> Blocks:
        """Apply `fn` to every block (axes [rows, *self.dims] → [rows, *dims])."""
        return Blocks([(i, fn(a)) for i, a in self.parts], dims, self.lengths)

    def tensors(self, prefix: str) -> dict[str, np.ndarray]:
        """The blocks as named arrays for a safetensors file: `{prefix}values.k` and `{prefix}index.k`."""
        out: dict[str, np.ndarray] = {}
        for k, (i, a) in enumerate(self.parts):
            out[f"{prefix}values.{k}"], out[f"{prefix}index.{k}"] = np.ascontiguousarray(a), i
        return out

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, np.ndarray],
        prefix: str,
        count: object,
        dims: tuple[str, ...],
        lengths: list[int],
        what: str,
        rows: list[int] | None = None,
    ) -> Blocks:
        """The inverse of `tensors` for `count` blocks, checked (`checked`)."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise MixlensError(f"{what}: the manifest gives no valid block count ({count!r})")
        parts = []
        for k in range(count):
            a, i = tensors.get(f"{prefix}values.{k}"), tensors.get(f"{prefix}index.{k}")
            if a is None or i is None:
                raise MixlensError(f"{what}: block {k} is missing from the tensor file")
            parts.append((i, a))
        return cls.checked(parts, dims, lengths, what, rows)


class BiasBlocks(Blocks):
    """The bias part of the norm output, g_i(b_O) + β = P(b_O) / s_i + β: [rows, layer, target, hidden] per block,
    built when read from what is stored, the per-token scale s_i (`scale`, a Blocks of [layer, target], 0 at
    padding) and the per-layer `terms` [layer, 2, hidden] (P(b_O), β). Holds L·n instead of L·n·d floats per
    input."""

    def __init__(self, scale: Blocks, terms: np.ndarray):
        self.scale, self.terms = scale, terms
        self.dims, self.lengths = ("layer", "target", "hidden"), scale.lengths
        self._where, self._full = scale._where, None

    def _bias(self, s: np.ndarray) -> np.ndarray:
        """[rows, L, n] scales → [rows, L, n, d] bias, 0 at padding."""
        inv = np.divide(1, s, out=np.zeros_like(s), where=s > 0)
        return (inv[..., None] * self.terms[:, 0, None] + self.terms[:, 1, None]) * (s > 0)[..., None]

    @property
    def parts(self) -> list[tuple[np.ndarray, np.ndarray]]:  # type: ignore[override]
        return [(i, self._bias(s)) for i, s in self.scale.parts]

    @property
    def nbytes(self) -> int:
        return self.scale.nbytes + self.terms.nbytes

    def row(self, b: int) -> np.ndarray:
        return self._bias(self.scale.row(b)[None])[0]

    @classmethod
    def concat(cls, stores: Sequence[Blocks], lengths: list[int]) -> Blocks:
        """Lazy again when every store is a BiasBlocks of the same per-layer terms."""
        if all(isinstance(s, BiasBlocks) for s in stores):
            lazy = [s for s in stores if isinstance(s, BiasBlocks)]
            if all(np.array_equal(s.terms, lazy[0].terms) for s in lazy):
                return cls(Blocks.concat([s.scale for s in lazy], lengths), lazy[0].terms)
        return Blocks.concat(stores, lengths)


# ---- reading untrusted files ----


def _read_manifest(path: Path) -> dict[str, Any]:
    from mixlens import jsonio

    return jsonio.read(path)


def _read_tensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
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
            and all(_is_int(x) and x >= 0 for x in info["shape"])
            and isinstance(info.get("data_offsets"), list)
            and len(info["data_offsets"]) == 2
            and all(_is_int(x) for x in info["data_offsets"])
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


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _get(man: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path) -> Any:
    if key not in man:
        raise MixlensError(f"{path}: missing field '{key}'")
    if not isinstance(man[key], kind) or isinstance(man[key], bool) and kind is not bool:
        raise MixlensError(f"{path}: field '{key}' has the wrong type ({type(man[key]).__name__})")
    return man[key]


def _tokens(man: dict[str, Any], path: Path) -> list[list[str]]:
    tokens = _get(man, "tokens", list, path)
    if not tokens or not all(isinstance(t, list) and t and all(isinstance(x, str) for x in t) for t in tokens):
        raise MixlensError(f"{path}: 'tokens' must be a non-empty list of non-empty token lists")
    return tokens


def _words(man: dict[str, Any], tokens: list[list[str]], path: Path) -> list[list[int | None]] | None:
    words = man.get("words")
    if words is None:
        return None
    if (
        not isinstance(words, list)
        or len(words) != len(tokens)
        or not all(
            isinstance(w, list) and len(w) == len(t) and all(x is None or _is_int(x) for x in w)
            for w, t in zip(words, tokens, strict=False)
        )
    ):
        raise MixlensError(f"{path}: 'words' must give a word id (or null) for every token")
    return words


def _dims(value: object, path: Path, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(d, str) for d in value) or len(set(value)) != len(value):
        raise MixlensError(f"{path}: {what} must be a list of distinct axis names")
    return tuple(value)


def _check_save_id(man: dict[str, Any], meta: dict[str, str], path: Path) -> None:
    if man.get("save_id") != meta.get(SAVE_ID):
        raise MixlensError(f"{path}: the manifest and the tensor file come from different saves")


def _json_default(x: object) -> str:
    """Option values JSON cannot hold (a Python callable target) are recorded by name."""
    return f"<{getattr(x, '__qualname__', type(x).__name__)}>"


def _write(path: Path, tensors: dict[str, np.ndarray], manifest: dict[str, Any]) -> None:
    """The tensor file, then the manifest (the commit point), both atomically, tied by a fresh save id."""
    from safetensors.numpy import save

    save_id = uuid.uuid4().hex
    atomic_write(path.with_suffix(".safetensors"), save(tensors, metadata={SAVE_ID: save_id}))
    atomic_write(
        path.with_suffix(".json"), json.dumps({**manifest, "save_id": save_id}, default=_json_default).encode()
    )


class Attribution:
    """Values of one method for a batch of inputs.

    `values` has axes `("batch", *dims)`; `target`/`source` axes are padded to the longest input and
    padded entries are 0. `tokens[b]` lists the real tokens of input b (special tokens included), and
    `words[b][k]` the word index of token k (None for special tokens). Results of `Lens.analyze` are stored per
    batch (`store`, a `Blocks`); `values` is then built on first use (a convenience for small results: it pads
    every input to the longest one) — `input(b)`, `sel`, `mean`, `to_words`, `to_dataframe`, `save` never build it.
    `extra_store[name]` holds the method's secondary outputs (e.g. `delta` of integrated gradients) per input;
    `extras[name]` is the padded [batch, *axes] array.
    In target-row mode `targets[b]` lists the token positions of input b's rows on the `target` axis (None: all).
    """

    def __init__(
        self,
        values: np.ndarray | Blocks,
        dims: tuple[str, ...],
        tokens: list[list[str]],
        method: str,
        model: str = "",
        params: dict[str, Any] | None = None,
        words: list[list[int | None]] | None = None,
        extras: dict[str, Blocks] | None = None,
        targets: list[list[int]] | None = None,
    ):
        self.dims = tuple(dims)
        self.targets = targets
        self.tokens = tokens
        self.method = method
        self.model = model
        self.params = params or {}
        self.words = words
        self.extra_store = dict(extras or {})
        if isinstance(values, Blocks):
            self.store = values
        else:
            if values.ndim != len(self.dims) + 1:
                raise ValueError(f"values have {values.ndim} axes, dims name {len(self.dims) + 1}")
            self.store = Blocks.of(values, self.dims, self.lengths)

    @property
    def values(self) -> np.ndarray:
        return self.store.full()

    @property
    def extras(self) -> dict[str, np.ndarray]:
        """Secondary outputs: name → [batch, *axes] (token axes zero-padded; built on first use)."""
        return {k: s.full() for k, s in self.extra_store.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of values held (the per-batch blocks)."""
        return self.store.nbytes + sum(s.nbytes for s in self.extra_store.values())

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def __len__(self) -> int:
        return len(self.tokens)

    def _like(self, store: Blocks, dims: tuple[str, ...], params: dict[str, Any], touched: set[str]) -> Attribution:
        """A derived attribution; extras with an axis in `touched` no longer describe it and are dropped."""
        extras = {k: s for k, s in self.extra_store.items() if not touched & set(s.dims)}
        return Attribution(
            store,
            dims,
            self.tokens,
            self.method,
            self.model,
            {**self.params, **params},
            self.words,
            extras,
            self.targets if "target" in dims else None,
        )

    def input(self, b: int) -> np.ndarray:
        """Values of input b without padding: axes `dims`."""
        return self.store.row(b)

    def sel(self, **index: int) -> Attribution:
        """Pick one position on named axes, e.g. `sel(layer=-1, head=3)`; those axes are dropped."""
        bad = set(index) - set(self.dims)
        if bad:
            raise MixlensError(f"no axis {sorted(bad)}; axes: {self.dims}")
        idx = (slice(None), *(index.get(d, slice(None)) for d in self.dims))
        dims = tuple(d for d in self.dims if d not in index)
        return self._like(
            self.store.map(lambda a: a[idx], dims), dims, {f"sel_{k}": v for k, v in index.items()}, set(index)
        )

    def mean(self, dim: str) -> Attribution:
        """Average over one named axis (e.g. heads)."""
        ax = self.dims.index(dim) + 1
        dims = tuple(d for d in self.dims if d != dim)
        return self._like(self.store.map(lambda a: a.mean(ax), dims), dims, {f"mean_{dim}": True}, {dim})

    def to_words(self) -> Attribution:
        """Word-level maps (docs/DESIGN.md §3.8): attention *to* a word sums its pieces, *from* a word averages.

        Special tokens stay as their own 'words'. Needs `target` and `source` as the last two axes.
        """
        if self.words is None or self.dims[-2:] != ("target", "source") or self.targets is not None:
            raise MixlensError("word grouping needs token→word ids and [..., target, source] axes with every target")
        groups = [_word_groups(w) for w in self.words]
        parts = []
        for idx, a in self.store.parts:
            m = max(len(groups[b]) for b in idx)
            out = np.zeros((*a.shape[:-2], m, m), dtype=a.dtype)
            for r, b in enumerate(idx.tolist()):
                g, n = groups[b], len(self.words[b])
                onehot = np.zeros((len(g), n), dtype=a.dtype)
                for k, members in enumerate(g):
                    onehot[k, members] = 1.0
                frm = onehot / onehot.sum(1, keepdims=True)
                out[r, ..., : len(g), : len(g)] = frm @ a[r, ..., :n, :n] @ onehot.T
            parts.append((idx, out))
        toks = [
            [
                "".join(t.removeprefix("##") if i else t for i, t in enumerate(self.tokens[b][j] for j in members))
                for members in g
            ]
            for b, g in enumerate(groups)
        ]
        extras = {k: s for k, s in self.extra_store.items() if not set(TOKEN_AXES) & set(s.dims)}
        return Attribution(
            Blocks(parts, self.dims, [len(g) for g in groups]),
            self.dims,
            toks,
            self.method,
            self.model,
            {**self.params, "words": True},
            [list(range(len(g))) for g in groups],
            extras,
        )

    def to_dataframe(self):  # -> pandas.DataFrame
        """Long table of real (non-pad) entries: one column per axis, token strings, and `value`."""
        import pandas as pd

        frames = []
        for b in range(len(self)):
            arr = self.input(b)
            grid = np.indices(arr.shape).reshape(len(self.dims), -1)
            df = pd.DataFrame({d: grid[k] for k, d in enumerate(self.dims)})
            df.insert(0, "batch", b)
            if self.targets is not None and "target" in df:  # row k → its token position
                df["target"] = np.asarray(self.targets[b])[df["target"].to_numpy()]
            for d in ("target", "source"):
                if d in df:
                    df[f"{d}_token"] = np.asarray(self.tokens[b], dtype=object)[df[d].to_numpy()]
            df["value"] = arr.reshape(-1)
            frames.append(df)
        return pd.concat(frames, ignore_index=True)

    def _repr_html_(self) -> str:
        """Interactive view in notebooks (offline; unique ids, so several outputs share a page)."""
        from mixlens.viz.html import render_fragment

        return render_fragment(self)

    def show(
        self,
        inputs: int | Sequence[int] | None = None,
        *,
        layer: int = -1,
        head: int | None = None,
        max_tokens: int = 16,
        console: Any = None,
    ) -> None:
        """Print a readable terminal view (rich) of `inputs` (default: all): token × token maps as a shaded table
        of one layer (default the last) and one head (default: the mean over heads), per-token scores as
        tokens with their scores and bars. At most `max_tokens` tokens per axis are shown (said when cut)."""
        from mixlens.viz.terminal import show_attribution

        show_attribution(self, inputs, layer=layer, head=head, max_tokens=max_tokens, console=console)

    def to_json_dict(self, b: int) -> dict[str, Any]:
        out = {
            "dims": list(self.dims),
            "values": self.input(b).tolist(),
            "extras": {k: {"dims": list(s.dims), "values": s.row(b).tolist()} for k, s in self.extra_store.items()},
        }
        return out if self.targets is None else {**out, "targets": self.targets[b]}

    def manifest(self) -> dict[str, Any]:
        return {
            "format": ATTRIBUTION_FORMAT,
            "method": self.method,
            "model": self.model,
            "dims": ["batch", *self.dims],
            "tokens": self.tokens,
            "words": self.words,
            "params": self.params,
            "targets": self.targets,
            "blocks": len(self.store.parts),
            "extras": {k: {"dims": list(s.dims), "blocks": len(s.parts)} for k, s in self.extra_store.items()},
        }

    def save(self, path: str | Path) -> None:
        """`path.safetensors` (per-batch blocks `values.k` with the input numbers `index.k`; extras as
        `extra.NAME.values.k` / `extra.NAME.index.k`) + `path.json` (manifest). No pickles; atomic writes."""
        tensors = self.store.tensors("")
        for k, s in self.extra_store.items():
            tensors |= s.tensors(f"extra.{k}.")
        _write(Path(path), tensors, self.manifest())

    @classmethod
    def load(cls, path: str | Path) -> Attribution:
        """Read what `save` wrote; every field and tensor is checked (`MixlensError` on a bad or crafted file)."""
        path = Path(path)
        man_path = path.with_suffix(".json")
        man = _read_manifest(man_path)
        if man.get("format") == ANALYSIS_FORMAT:
            raise MixlensError(f"{man_path} is a saved analysis: use Analysis.load")
        tokens = _tokens(man, man_path)
        dims = _dims(_get(man, "dims", list, man_path), man_path, "'dims'")
        if not dims or dims[0] != "batch":
            raise MixlensError(f"{man_path}: 'dims' must start with 'batch'")
        dims = dims[1:]
        method, model = _get(man, "method", str, man_path), _get(man, "model", str, man_path)
        params, words = _get(man, "params", dict, man_path), _words(man, tokens, man_path)
        extras_man = man.get("extras", {})
        if not isinstance(extras_man, dict) or not all(isinstance(e, dict) for e in extras_man.values()):
            raise MixlensError(f"{man_path}: 'extras' must map names to their axes and block counts")
        targets = _targets(man, tokens, man_path)
        rows = None if targets is None else [len(r) for r in targets]
        tensors, meta = _read_tensors(path.with_suffix(".safetensors"))
        _check_save_id(man, meta, man_path)
        lengths = [len(t) for t in tokens]
        what = f"{path.with_suffix('.safetensors')}"
        if "values" in tensors:  # one padded array (files of earlier versions)
            store = Blocks.checked([(np.arange(len(tokens)), tensors["values"])], dims, lengths, what, rows)
        else:
            count = man.get("blocks", sum(k.startswith("values.") for k in tensors))
            store = Blocks.from_tensors(tensors, "", count, dims, lengths, what, rows)
        extras = {
            k: Blocks.from_tensors(
                tensors,
                f"extra.{k}.",
                e.get("blocks"),
                _dims(e.get("dims"), man_path, f"extra '{k}' axes"),
                lengths,
                what,
            )
            for k, e in extras_man.items()
        }
        return cls(store, dims, tokens, method, model, params, words, extras, targets)


def _targets(man: dict[str, Any], tokens: list[list[str]], path: Path) -> list[list[int]] | None:
    """The target positions of target-row mode from a manifest, checked against the tokens (None: every row)."""
    targets = man.get("targets")
    if targets is None:
        return None
    if (
        not isinstance(targets, list)
        or len(targets) != len(tokens)
        or not all(
            isinstance(r, list) and all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < len(t) for p in r)
            for r, t in zip(targets, tokens, strict=True)
        )
    ):
        raise MixlensError(f"{path}: 'targets' must list, per input, token positions inside that input")
    return targets


def _word_groups(words: list[int | None]) -> list[list[int]]:
    groups: list[list[int]] = []
    last = object()
    for k, w in enumerate(words):
        if w is not None and w == last:
            groups[-1].append(k)
        else:
            groups.append([k])
        last = w
    return groups


class Analysis:
    """Everything one `Lens.analyze` call computed: methods by name, mixing ratios and self-checks.

    `ratios` (variant → [batch, layer, target]) and `bias` ([batch, layer, target, d], g_i(b_O) + β) are stored per
    batch like the attributions and padded to the longest input only when read; both are empty / None and
    `reconstruction_error` ([batch], max abs over layers) is None when no requested method used the norm engine.
    An analysis read from `mixlens analyze`'s JSON knows only each input's per-layer mean ratio
    (`ratio_means_only`): its per-token `ratios` repeat that mean on every token (exact means, pooled means and
    sums), and `mixing_ratio(per_token=True)` is refused.
    """

    def __init__(
        self,
        model: str,
        version: str,
        texts: list[str],
        tokens: list[list[str]],
        attributions: dict[str, Attribution],
        ratios: Mapping[str, np.ndarray | Blocks],
        reconstruction_error: np.ndarray | None,
        bias: np.ndarray | Blocks | None = None,
        ratio_means_only: bool = False,
        explained: list[dict[str, Any]] | None = None,
    ):
        self.model, self.version, self.texts, self.tokens = model, version, texts, tokens
        self.explained = explained  # per input, the target its scores explain (`Explanation`); None otherwise
        self.attributions = attributions
        self.reconstruction_error = reconstruction_error
        self.ratio_means_only = ratio_means_only
        self._ratio_means: dict[str, np.ndarray] | None = None  # read from analyze's JSON: [batch, layer] per variant
        lengths = [len(t) for t in tokens]
        self.ratio_store = {
            v: r if isinstance(r, Blocks) else Blocks.of(r, ("layer", "target"), lengths) for v, r in ratios.items()
        }
        self.bias_store = (
            bias
            if bias is None or isinstance(bias, Blocks)
            else Blocks.of(bias, ("layer", "target", "hidden"), lengths)
        )

    @property
    def ratios(self) -> dict[str, np.ndarray]:
        """variant → [batch, layer, target] per-token mixing ratios, padding 0 (built on first use)."""
        return {v: r.full() for v, r in self.ratio_store.items()}

    @property
    def bias(self) -> np.ndarray | None:
        """[batch, layer, target, d] g_i(b_O) + β, padding 0 (built on first use)."""
        return None if self.bias_store is None else self.bias_store.full()

    @property
    def nbytes(self) -> int:
        """Bytes of per-input arrays held (attributions, ratios, bias)."""
        return (
            sum(a.nbytes for a in self.attributions.values())
            + sum(s.nbytes for s in self.ratio_store.values())
            + (self.bias_store.nbytes if self.bias_store is not None else 0)
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, method: str) -> Attribution:
        try:
            return self.attributions[method]
        except KeyError:
            raise MixlensError(f"'{method}' was not computed; have {sorted(self.attributions)}") from None

    def __contains__(self, method: str) -> bool:
        return method in self.attributions

    def mixing_ratio(self, variant: str = "ResLN-N", per_token: bool = False) -> np.ndarray:
        """Context-mixing ratio r (Kobayashi 2021): [batch, layer], mean over real tokens, or
        [batch, layer, target] per token (padding 0)."""
        if not self.ratio_store:
            raise MixlensError("no mixing ratios: none of the methods used the norm engine (e.g. add 'norm')")
        if variant not in self.ratio_store:
            raise MixlensError(f"unknown mixing-ratio variant '{variant}'; valid: {', '.join(self.ratio_store)}")
        store = self.ratio_store[variant]
        if per_token:
            if self.ratio_means_only:
                raise MixlensError(
                    "this analysis was read from analyze's JSON, which holds only per-layer means "
                    "of the mixing ratios; save it with Analysis.save for per-token ratios"
                )
            return store.full()
        if self._ratio_means is not None:
            return self._ratio_means[variant]
        lengths = np.array([len(t) for t in self.tokens])
        out = np.zeros((len(self.tokens), store.parts[0][1].shape[1]), store.parts[0][1].dtype)
        for idx, r in store.parts:
            out[idx] = r.sum(-1) / lengths[idx, None].astype(r.dtype)
        return out

    def _repr_html_(self) -> str:
        """Interactive report view in notebooks (offline; unique ids, so several outputs share a page)."""
        from mixlens.viz.html import render_fragment

        return render_fragment(self)

    def to_json(self) -> dict[str, Any]:
        """The documented JSON contract (README, 'JSON output')."""
        means = {v: self.mixing_ratio(v) for v in self.ratio_store}
        err = self.reconstruction_error
        return {
            "model": self.model,
            "version": self.version,
            "inputs": [
                {
                    "text": self.texts[b],
                    "tokens": self.tokens[b],
                    "methods": {k: a.to_json_dict(b) for k, a in self.attributions.items()},
                    "mixing_ratio": {v: means[v][b].tolist() for v in means},
                    "reconstruction_error": None if err is None else float(err[b]),
                    **({} if self.explained is None else {"target": self.explained[b]}),
                }
                for b in range(len(self.texts))
            ],
        }

    # ---- files ----

    def save(self, path: str | Path) -> None:
        """`path.safetensors` (every per-batch block: methods `method.NAME.`, their extras `extra.NAME.KEY.`,
        ratios `ratio.VARIANT.`, `bias.`, each as `values.k` / `index.k`; `reconstruction_error`) + `path.json`
        (manifest). No pickles; atomic writes; reload with `Analysis.load`."""
        rowed = [name for name, a in self.attributions.items() if a.targets is not None]
        if rowed:
            raise MixlensError(
                f"saving an analysis of target rows ({', '.join(rowed)}) is not supported; save each "
                "Attribution with .save(), or analyse all rows"
            )
        tensors: dict[str, np.ndarray] = {}
        methods: dict[str, Any] = {}
        for name, a in self.attributions.items():
            tensors |= a.store.tensors(f"method.{name}.")
            for k, s in a.extra_store.items():
                tensors |= s.tensors(f"extra.{name}.{k}.")
            methods[name] = {
                "dims": list(a.dims),
                "params": a.params,
                "blocks": len(a.store.parts),
                "extras": {k: {"dims": list(s.dims), "blocks": len(s.parts)} for k, s in a.extra_store.items()},
            }
        for v, s in self.ratio_store.items():
            tensors |= s.tensors(f"ratio.{v}.")
        if self.bias_store is not None:
            tensors |= self.bias_store.tensors("bias.")
        if self.reconstruction_error is not None:
            tensors["reconstruction_error"] = np.ascontiguousarray(self.reconstruction_error)
        first = next(iter(self.attributions.values()), None)
        manifest = {
            "format": ANALYSIS_FORMAT,
            "model": self.model,
            "version": self.version,
            "texts": self.texts,
            "tokens": self.tokens,
            "words": first.words if first is not None else None,
            "methods": methods,
            "ratios": {v: len(s.parts) for v, s in self.ratio_store.items()},
            "ratio_means_only": self.ratio_means_only,
            "bias": None if self.bias_store is None else len(self.bias_store.parts),
            "reconstruction_error": self.reconstruction_error is not None,
            "explained": self.explained,
        }
        _write(Path(path), tensors, manifest)

    @classmethod
    def load(cls, path: str | Path) -> Analysis:
        """Read a saved analysis (`save`), or the JSON written by `mixlens analyze` (per-layer mean ratios only,
        see the class doc). Every field and tensor is checked (`MixlensError` on a bad or crafted file)."""
        path = Path(path)
        man_path = path if path.suffix == ".json" else path.with_suffix(".json")
        man = _read_manifest(man_path)
        if man.get("format") == ANALYSIS_FORMAT:
            return _typed(cls._from_saved(man, man_path))
        if "inputs" in man and "format" not in man:
            return _typed(cls.from_json(man, str(man_path)))
        raise MixlensError(f"{man_path} is neither a saved analysis nor the JSON of `mixlens analyze`")

    @classmethod
    def _from_saved(cls, man: dict[str, Any], path: Path) -> Analysis:
        tokens = _tokens(man, path)
        words = _words(man, tokens, path)
        texts = _get(man, "texts", list, path)
        if len(texts) != len(tokens) or not all(isinstance(t, str) for t in texts):
            raise MixlensError(f"{path}: 'texts' must hold one string per input")
        model, version = _get(man, "model", str, path), _get(man, "version", str, path)
        methods, ratio_man = _get(man, "methods", dict, path), _get(man, "ratios", dict, path)
        tensors, meta = _read_tensors(path.with_suffix(".safetensors"))
        _check_save_id(man, meta, path)
        lengths, what = [len(t) for t in tokens], str(path.with_suffix(".safetensors"))
        attributions = {}
        for name, m in methods.items():
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("params"), dict)
                or not isinstance(m.get("extras", {}), dict)
            ):
                raise MixlensError(f"{path}: method '{name}' has a malformed entry")
            dims = _dims(m.get("dims"), path, f"the axes of '{name}'")
            store = Blocks.from_tensors(tensors, f"method.{name}.", m.get("blocks"), dims, lengths, what)
            extras = {}
            for k, e in m.get("extras", {}).items():
                if not isinstance(e, dict):
                    raise MixlensError(f"{path}: extra '{k}' of '{name}' has a malformed entry")
                extras[k] = Blocks.from_tensors(
                    tensors,
                    f"extra.{name}.{k}.",
                    e.get("blocks"),
                    _dims(e.get("dims"), path, f"the axes of '{name}.{k}'"),
                    lengths,
                    what,
                )
            attributions[name] = Attribution(store, dims, tokens, name, model, m["params"], words, extras)
        ratios = {
            v: Blocks.from_tensors(tensors, f"ratio.{v}.", k, ("layer", "target"), lengths, what)
            for v, k in ratio_man.items()
        }
        bias = (
            None
            if man.get("bias") is None
            else Blocks.from_tensors(tensors, "bias.", man["bias"], ("layer", "target", "hidden"), lengths, what)
        )
        _check_layers(attributions, ratios, bias, str(path))
        err = None
        if man.get("reconstruction_error"):
            err = tensors.get("reconstruction_error")
            if err is None or err.shape != (len(tokens),) or err.dtype.kind != "f":
                raise MixlensError(f"{what}: 'reconstruction_error' must hold one number per input")
        explained = _explained(man.get("explained"), len(tokens), str(path))
        return cls(
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

    @classmethod
    def from_json(cls, obj: object, where: str = "the JSON") -> Analysis:
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
        rows: dict[str, list[list[int] | None]] = {}  # target-row mode (`analyze --targets`): positions per input
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
                d = _dims(m.get("dims"), Path(where), f"the axes of '{name}'")
                if dims.setdefault(name, d) != d:
                    raise MixlensError(f"{at}: '{name}' has other axes than in input 1")
                pos = _json_targets(m.get("targets"), d, len(toks), f"{at}: '{name}'")
                if b and (pos is None) != (rows[name][0] is None):
                    raise MixlensError(f"{at}: '{name}' gives target rows for some inputs only")
                rows.setdefault(name, []).append(pos)
                values.setdefault(name, []).append(
                    _array(m.get("values"), d, len(toks), f"{at}: '{name}'", None if pos is None else len(pos))
                )
                ex = m.get("extras", {})
                if not isinstance(ex, dict) or (b and set(ex) != set(extras.get(name, {}))):
                    raise MixlensError(f"{at}: the extras of '{name}' differ from input 1 or are malformed")
                for k, e in ex.items():
                    if not isinstance(e, dict):
                        raise MixlensError(f"{at}: extra '{name}.{k}' is not an object")
                    ed = _dims(e.get("dims"), Path(where), f"the axes of '{name}.{k}'")
                    if extra_dims.setdefault((name, k), ed) != ed:
                        raise MixlensError(f"{at}: extra '{name}.{k}' has other axes than in input 1")
                    extras.setdefault(name, {}).setdefault(k, []).append(
                        _array(e.get("values"), ed, len(toks), f"{at}: '{name}.{k}'")
                    )
            for v, r in ratio.items():
                means.setdefault(v, []).append(_array(r, ("layer",), len(toks), f"{at}: mixing ratio '{v}'"))
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
            raise MixlensError(
                f"{where}: the mixing ratios and the methods give different layer counts ({sorted(layers)})"
            )
        lengths = [len(t) for t in tokens]

        def store(arrs: list[np.ndarray], d: tuple[str, ...]) -> Blocks:
            return Blocks([(np.array([b]), a[None]) for b, a in enumerate(arrs)], d, lengths)

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
        err_arr = None if errors[0] is None else np.asarray(errors, np.float32)
        targets = None if all(t is None for t in explained) else _explained(explained, len(tokens), where)
        res = cls(model, version, texts, tokens, attributions, ratios, err_arr, None, True, targets)
        res._ratio_means = {v: np.stack(ms) for v, ms in means.items()}
        return res

    @classmethod
    def concat(cls, analyses: Sequence[Analysis]) -> Analysis:
        """One analysis holding the inputs of several, in order; they must come from the same model, mixlens
        version and methods (axes, options, extras, ratio variants)."""
        if not analyses:
            raise MixlensError("nothing to concatenate")
        first = analyses[0]

        def shape(a: Analysis) -> object:
            return (
                {
                    k: (
                        x.dims,
                        json.dumps(x.params, sort_keys=True, default=_json_default),
                        {e: s.dims for e, s in x.extra_store.items()},
                    )
                    for k, x in a.attributions.items()
                },
                sorted(a.ratio_store),
                a.bias_store is None,
                a.reconstruction_error is None,
                a.ratio_means_only,
                a.explained is None,
            )

        for k, a in enumerate(analyses[1:], 2):
            if a.model != first.model or a.version != first.version:
                raise MixlensError(
                    f"analysis {k} comes from {a.model} (mixlens {a.version}), analysis 1 from "
                    f"{first.model} (mixlens {first.version})"
                )
            if shape(a) != shape(first):
                raise MixlensError(f"analysis {k} has other methods, options, extras or ratios than analysis 1")
        tokens = [t for a in analyses for t in a.tokens]
        lengths = [len(t) for t in tokens]
        words = (
            [w for a in analyses for w in (next(iter(a.attributions.values())).words or [])]
            if first.attributions and all(next(iter(a.attributions.values())).words for a in analyses)
            else None
        )
        attributions = {}
        for name, x in first.attributions.items():
            parts = [a.attributions[name] for a in analyses]
            extras = {e: Blocks.concat([p.extra_store[e] for p in parts], lengths) for e in x.extra_store}
            attributions[name] = Attribution(
                Blocks.concat([p.store for p in parts], lengths), x.dims, tokens, name, x.model, x.params, words, extras
            )
        ratios = {v: Blocks.concat([a.ratio_store[v] for a in analyses], lengths) for v in first.ratio_store}
        bias = (
            None
            if first.bias_store is None
            else BiasBlocks.concat([a.bias_store for a in analyses if a.bias_store is not None], lengths)
        )
        err = (
            None
            if first.reconstruction_error is None
            else np.concatenate([a.reconstruction_error for a in analyses if a.reconstruction_error is not None])
        )
        explained = None if first.explained is None else [t for a in analyses for t in a.explained or []]
        return _typed(
            cls(
                first.model,
                first.version,
                [t for a in analyses for t in a.texts],
                tokens,
                attributions,
                ratios,
                err,
                bias,
                first.ratio_means_only,
                explained,
            )
        )


def _explained(value: object, n: int, where: str) -> list[dict[str, Any]] | None:
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
            and set(t) <= {"kind", "label", "score", "foil", "index", "foil_index", "probability", "foil_probability"}
        )
        if not ok:
            raise MixlensError(f"{where}: input {b + 1}'s target must have a string kind and label and a number score")
    return value


def _typed(res: Analysis) -> Analysis:
    """An analysis that explains targets is an `Explanation` (its views); any other stays an `Analysis`."""
    if res.explained is None or isinstance(res, Explanation):
        return res
    out = Explanation.__new__(Explanation)
    out.__dict__.update(res.__dict__)
    out.timings = {}
    return out


@dataclass
class Explained:
    """One explained input, as the views read it: tokens, target, its score (f(x), or g(x) for a contrast) and one
    score per token for each method ([n])."""

    text: str
    tokens: list[str]
    target: Any  # mixlens.targets.Target
    score: float
    scores: dict[str, np.ndarray]
    probability: float | None = None  # the target's probability (classes or vocabulary), when the model has logits
    foil_probability: float | None = None
    extras: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # method → its secondary outputs


class Explanation(Analysis):
    """What `mixlens.explain` computed: one score per token and method (`[batch, source]`) for the target of each
    input (`explained[b]`: kind, label, score — f(x), or g(x) with a foil — and the foil's label). It is an
    `Analysis`: `save` / `Analysis.load` / `concat` / `mixlens report --from`; `.show()` prints it, `.html()` is a
    self-contained page, `_repr_html_` the notebook view. `timings`: seconds per method (not saved)."""

    timings: dict[str, float]

    def __init__(self, *args: Any, timings: dict[str, float] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.timings = dict(timings or {})

    @property
    def methods(self) -> list[str]:
        return list(self.attributions)

    @property
    def inputs(self) -> list[Explained]:
        from mixlens.targets import Target

        out = []
        for b, t in enumerate(self.explained or []):
            foil = t.get("foil_index", -1) if "foil" in t else None
            target = Target(t["kind"], t.get("index", -1), t["label"], foil, t.get("foil"))
            score = float("nan") if t.get("score") is None else float(t["score"])
            scores = {m: a.input(b) for m, a in self.attributions.items()}
            extras = {m: {k: s.row(b) for k, s in a.extra_store.items()} for m, a in self.attributions.items()}
            out.append(
                Explained(
                    self.texts[b],
                    self.tokens[b],
                    target,
                    score,
                    scores,
                    t.get("probability"),
                    t.get("foil_probability"),
                    {m: e for m, e in extras.items() if e},
                )
            )
        return out

    def to_json(self) -> dict[str, Any]:
        """The analysis JSON (`Analysis.to_json`, each input's 'target' included) plus each input's 'scores'
        (method → one number per token), the short form `explain` has always written."""
        doc = super().to_json()
        for b, inp in enumerate(doc["inputs"]):
            inp["scores"] = {m: [float(v) for v in a.input(b)] for m, a in self.attributions.items()}
        return doc

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    def html(self) -> str:
        from mixlens.viz.highlight import render_page

        return render_page(self)

    def _repr_html_(self) -> str:
        from mixlens.viz.highlight import render_fragment

        return render_fragment(self)

    def show(self, console: Any = None) -> None:
        from mixlens.viz.highlight import print_terminal

        print_terminal(self, console)


def _array(value: object, dims: tuple[str, ...], n: int, what: str, rows: int | None = None) -> np.ndarray:
    """Nested lists of numbers → a float32 array with one axis per name in `dims`, token axes of length n (the
    `target` axis of target-row mode: `rows`). Only numbers are accepted (not strings, booleans or null)."""
    if isinstance(value, (str, bytes)):
        raise MixlensError(f"{what}: values are not a regular array of numbers")
    try:
        a = np.asarray(value)
    except (TypeError, ValueError, RecursionError):
        raise MixlensError(f"{what}: values are not a regular array of numbers") from None
    if a.dtype.kind not in "iuf":  # strings, objects (ragged lists, null) and booleans
        raise MixlensError(f"{what}: values are not a regular array of numbers")
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


def _check_layers(
    attributions: Mapping[str, Attribution], ratios: Mapping[str, Blocks], bias: Blocks | None, where: str
) -> None:
    """Every 'layer' axis of a loaded analysis (methods, extras, mixing ratios, bias) has the same length."""
    found: dict[int, str] = {}
    stores = [(f"'{n}'", a.store) for n, a in attributions.items()]
    stores += [(f"'{n}.{k}'", e) for n, a in attributions.items() for k, e in a.extra_store.items()]
    stores += [(f"mixing ratio '{v}'", r) for v, r in ratios.items()] + ([("the bias", bias)] if bias else [])
    for what, st in stores:
        if "layer" in st.dims:
            found.setdefault(int(st.parts[0][1].shape[1 + st.dims.index("layer")]), what)
    if len(found) > 1:
        (a, x), (b, y) = list(found.items())[:2]
        raise MixlensError(f"{where}: {x} has {a} layers but {y} has {b}")


def _json_targets(value: object, dims: tuple[str, ...], n: int, what: str) -> list[int] | None:
    """The `targets` of one method of one input in analyze's JSON (target-row mode): distinct integer positions
    inside the input's n tokens, for a method with a `target` axis; None when absent."""
    if value is None:
        return None
    if "target" not in dims:
        raise MixlensError(f"{what}: 'targets' given for a method without a 'target' axis")
    if (
        not isinstance(value, list)
        or not value
        or not all(_is_int(p) and 0 <= p < n for p in value)
        or len(set(value)) != len(value)
    ):
        raise MixlensError(
            f"{what}: 'targets' must list distinct integer token positions inside the input ({n} tokens)"
        )
    return value
