"""Result objects: `Attribution` (one method, labelled array) and `Analysis` (one `analyze` call)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mixlens.errors import MixlensError


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write to a temp file beside `path`, then rename: a crash never leaves a half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the user's usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


TOKEN_AXES = ("target", "source", "token")


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
                    out[(idx, *(slice(0, s) for s in a.shape[1:]))] = a
                self._full = out
        return self._full

    def map(self, fn: Callable[[np.ndarray], np.ndarray], dims: tuple[str, ...]) -> Blocks:
        """Apply `fn` to every block (axes [rows, *self.dims] → [rows, *dims])."""
        return Blocks([(i, fn(a)) for i, a in self.parts], dims, self.lengths)


class Attribution:
    """Values of one method for a batch of inputs.

    `values` has axes `("batch", *dims)`; `target`/`source` axes are padded to the longest input and
    padded entries are 0. `tokens[b]` lists the real tokens of input b (special tokens included), and
    `words[b][k]` the word index of token k (None for special tokens). Results of `Lens.analyze` are stored per
    batch (`store`, a `Blocks`); `values` is then built on first use (a convenience for small results: it pads
    every input to the longest one) — `input(b)`, `sel`, `mean`, `to_words`, `to_dataframe`, `save` never build it.
    In target-row mode `targets[b]` lists the token positions of input b's rows on the `target` axis (None: all).
    """

    def __init__(self, values: np.ndarray | Blocks, dims: tuple[str, ...], tokens: list[list[str]], method: str,
                 model: str = "", params: dict[str, Any] | None = None, words: list[list[int | None]] | None = None,
                 targets: list[list[int]] | None = None):
        self.dims = tuple(dims)
        self.targets = targets
        self.tokens = tokens
        self.method = method
        self.model = model
        self.params = params or {}
        self.words = words
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
    def nbytes(self) -> int:
        """Bytes of values held (the per-batch blocks)."""
        return self.store.nbytes

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def __len__(self) -> int:
        return len(self.tokens)

    def _like(self, store: Blocks, dims: tuple[str, ...], params: dict[str, Any]) -> Attribution:
        return Attribution(store, dims, self.tokens, self.method, self.model, {**self.params, **params}, self.words,
                           self.targets if "target" in dims else None)

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
        return self._like(self.store.map(lambda a: a[idx], dims), dims, {f"sel_{k}": v for k, v in index.items()})

    def mean(self, dim: str) -> Attribution:
        """Average over one named axis (e.g. heads)."""
        ax = self.dims.index(dim) + 1
        dims = tuple(d for d in self.dims if d != dim)
        return self._like(self.store.map(lambda a: a.mean(ax), dims), dims, {f"mean_{dim}": True})

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
        toks = [["".join(t.removeprefix("##") if i else t for i, t in enumerate(self.tokens[b][j] for j in members))
                 for members in g] for b, g in enumerate(groups)]
        return Attribution(Blocks(parts, self.dims, [len(g) for g in groups]), self.dims, toks, self.method,
                           self.model, {**self.params, "words": True}, [list(range(len(g))) for g in groups])

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

    def to_json_dict(self, b: int) -> dict[str, Any]:
        out = {"dims": list(self.dims), "values": self.input(b).tolist()}
        return out if self.targets is None else {**out, "targets": self.targets[b]}

    def manifest(self) -> dict[str, Any]:
        return {"method": self.method, "model": self.model, "dims": ["batch", *self.dims],
                "tokens": self.tokens, "words": self.words, "params": self.params, "targets": self.targets}

    def save(self, path: str | Path) -> None:
        """`path.safetensors` (values: one padded array `values`, or per-batch blocks `values.k` with the input
        numbers `index.k`) + `path.json` (manifest). No pickles."""
        from safetensors.numpy import save

        path = Path(path)
        parts = self.store.parts
        if len(parts) == 1 and np.array_equal(parts[0][0], np.arange(len(self))):
            tensors = {"values": np.ascontiguousarray(parts[0][1])}
        else:
            tensors = {f"{key}.{k}": np.ascontiguousarray(x) for k, (i, a) in enumerate(parts)
                       for key, x in (("values", a), ("index", i))}
        atomic_write(path.with_suffix(".safetensors"), save(tensors))
        atomic_write(path.with_suffix(".json"), json.dumps(self.manifest()).encode())

    @classmethod
    def load(cls, path: str | Path) -> Attribution:
        from safetensors.numpy import load_file

        path = Path(path)
        try:
            man = json.loads(path.with_suffix(".json").read_text())
            t = load_file(str(path.with_suffix(".safetensors")))
            dims = tuple(man["dims"][1:])
            values = t["values"] if "values" in t else Blocks(
                [(t[f"index.{k}"], t[f"values.{k}"]) for k in range(len(t) // 2)], dims,
                [len(x) for x in man["tokens"]])
        except (OSError, KeyError, ValueError) as e:
            raise MixlensError(f"cannot load attribution from {path}: {e}") from None
        return cls(values, dims, man["tokens"], man["method"], man["model"], man["params"], man.get("words"),
                   man.get("targets"))


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
    """

    def __init__(self, model: str, version: str, texts: list[str], tokens: list[list[str]],
                 attributions: dict[str, Attribution], ratios: dict[str, np.ndarray | Blocks],
                 reconstruction_error: np.ndarray | None, bias: np.ndarray | Blocks | None = None):
        self.model, self.version, self.texts, self.tokens = model, version, texts, tokens
        self.attributions = attributions
        self.reconstruction_error = reconstruction_error
        lengths = [len(t) for t in tokens]
        self.ratio_store = {v: r if isinstance(r, Blocks) else Blocks.of(r, ("layer", "target"), lengths)
                            for v, r in ratios.items()}
        self.bias_store = bias if bias is None or isinstance(bias, Blocks) else \
            Blocks.of(bias, ("layer", "target", "hidden"), lengths)

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
        stores = [a.store for a in self.attributions.values()] + list(self.ratio_store.values())
        return sum(s.nbytes for s in stores) + (self.bias_store.nbytes if self.bias_store is not None else 0)

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
            return store.full()
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
                }
                for b in range(len(self.texts))
            ],
        }
