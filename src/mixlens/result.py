"""Result objects: `Attribution` (one method, labelled array) and `Analysis` (one `analyze` call)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mixlens.errors import MixlensError


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write to a temp file beside `path`, then rename: a crash never leaves a half file. A directory at `path`
    or a failing filesystem (read-only, full, no permission) is a `MixlensError` naming the path."""
    path = Path(path)
    if path.is_dir():
        raise MixlensError(f"cannot write '{path}': it is a directory; give a file name")
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the user's usual mode
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise MixlensError(f"cannot write '{path}': {e.strerror or e}") from None
        raise


@dataclass
class Attribution:
    """Values of one method for a batch of inputs.

    `values` has axes `("batch", *dims)`; `target`/`source` axes are padded to the longest input and
    padded entries are 0. `tokens[b]` lists the real tokens of input b (special tokens included), and
    `words[b][k]` the word index of token k (None for special tokens).
    """

    values: np.ndarray
    dims: tuple[str, ...]
    tokens: list[list[str]]
    method: str
    model: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    words: list[list[int | None]] | None = None

    def __post_init__(self) -> None:
        if self.values.ndim != len(self.dims) + 1:
            raise ValueError(f"values have {self.values.ndim} axes, dims name {len(self.dims) + 1}")

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def __len__(self) -> int:
        return len(self.tokens)

    def input(self, b: int) -> np.ndarray:
        """Values of input b without padding: axes `dims`."""
        n = self.lengths[b]
        idx = tuple(slice(0, n) if d in ("target", "source", "token") else slice(None) for d in self.dims)
        return self.values[b][idx]

    def sel(self, **index: int) -> Attribution:
        """Pick one position on named axes, e.g. `sel(layer=-1, head=3)`; those axes are dropped."""
        bad = set(index) - set(self.dims)
        if bad:
            raise MixlensError(f"no axis {sorted(bad)}; axes: {self.dims}")
        idx = tuple(index.get(d, slice(None)) for d in self.dims)
        dims = tuple(d for d in self.dims if d not in index)
        return Attribution(self.values[(slice(None), *idx)], dims, self.tokens, self.method, self.model,
                           {**self.params, **{f"sel_{k}": v for k, v in index.items()}}, self.words)

    def mean(self, dim: str) -> Attribution:
        """Average over one named axis (e.g. heads)."""
        ax = self.dims.index(dim) + 1
        dims = tuple(d for d in self.dims if d != dim)
        return Attribution(self.values.mean(ax), dims, self.tokens, self.method, self.model,
                           {**self.params, f"mean_{dim}": True}, self.words)

    def to_words(self) -> Attribution:
        """Word-level maps (docs/DESIGN.md §3.8): attention *to* a word sums its pieces, *from* a word averages.

        Special tokens stay as their own 'words'. Needs `target` and `source` as the last two axes.
        """
        if self.words is None or self.dims[-2:] != ("target", "source"):
            raise MixlensError("word grouping needs token→word ids and [..., target, source] axes")
        groups = [_word_groups(w) for w in self.words]
        m = max(len(g) for g in groups)
        out = np.zeros((*self.values.shape[:-2], m, m), dtype=self.values.dtype)
        toks = []
        for b, g in enumerate(groups):
            n = len(self.words[b])
            onehot = np.zeros((len(g), n), dtype=self.values.dtype)
            for k, members in enumerate(g):
                onehot[k, members] = 1.0
            frm = onehot / onehot.sum(1, keepdims=True)
            out[b, ..., : len(g), : len(g)] = frm @ self.values[b, ..., :n, :n] @ onehot.T
            toks.append(["".join(t.removeprefix("##") if i else t for i, t in
                                 enumerate(self.tokens[b][j] for j in members)) for members in g])
        return Attribution(out, self.dims, toks, self.method, self.model, {**self.params, "words": True},
                           [list(range(len(g))) for g in groups])

    def to_dataframe(self):  # -> pandas.DataFrame
        """Long table of real (non-pad) entries: one column per axis, token strings, and `value`."""
        import pandas as pd

        frames = []
        for b in range(len(self)):
            arr = self.input(b)
            grid = np.indices(arr.shape).reshape(len(self.dims), -1)
            df = pd.DataFrame({d: grid[k] for k, d in enumerate(self.dims)})
            df.insert(0, "batch", b)
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
        return {"dims": list(self.dims), "values": self.input(b).tolist()}

    def manifest(self) -> dict[str, Any]:
        return {"method": self.method, "model": self.model, "dims": ["batch", *self.dims],
                "tokens": self.tokens, "words": self.words, "params": self.params}

    def save(self, path: str | Path) -> None:
        """`path.safetensors` (values) + `path.json` (manifest). No pickles."""
        from safetensors.numpy import save

        path = Path(path)
        atomic_write(path.with_suffix(".safetensors"), save({"values": np.ascontiguousarray(self.values)}))
        atomic_write(path.with_suffix(".json"), json.dumps(self.manifest()).encode())

    @classmethod
    def load(cls, path: str | Path) -> Attribution:
        from safetensors.numpy import load_file

        path = Path(path)
        try:
            man = json.loads(path.with_suffix(".json").read_text())
            values = load_file(str(path.with_suffix(".safetensors")))["values"]
        except (OSError, KeyError, ValueError) as e:
            raise MixlensError(f"cannot load attribution from {path}: {e}") from None
        return cls(values, tuple(man["dims"][1:]), man["tokens"], man["method"], man["model"], man["params"],
                   man.get("words"))


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


@dataclass
class Analysis:
    """Everything one `Lens.analyze` call computed: methods by name, mixing ratios and self-checks."""

    model: str
    version: str
    texts: list[str]
    tokens: list[list[str]]
    attributions: dict[str, Attribution]
    ratios: dict[str, np.ndarray]  # variant → [batch, layer, target] (padding 0)
    reconstruction_error: np.ndarray  # [batch] max abs over layers
    bias: np.ndarray | None = None  # [batch, layer, target, d] g_i(b_O) + β

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
        if variant not in self.ratios:
            raise MixlensError(f"unknown mixing-ratio variant '{variant}'; valid: {', '.join(self.ratios)}")
        r = self.ratios[variant]
        if per_token:
            return r
        lengths = np.array([len(t) for t in self.tokens], dtype=r.dtype)
        return r.sum(-1) / lengths[:, None]

    def _repr_html_(self) -> str:
        """Interactive report view in notebooks (offline; unique ids, so several outputs share a page)."""
        from mixlens.viz.html import render_fragment

        return render_fragment(self)

    def to_json(self) -> dict[str, Any]:
        """The documented JSON contract (README, 'JSON output')."""
        means = {v: self.mixing_ratio(v) for v in self.ratios}
        return {
            "model": self.model,
            "version": self.version,
            "inputs": [
                {
                    "text": self.texts[b],
                    "tokens": self.tokens[b],
                    "methods": {k: a.to_json_dict(b) for k, a in self.attributions.items()},
                    "mixing_ratio": {v: means[v][b].tolist() for v in means},
                    "reconstruction_error": float(self.reconstruction_error[b]),
                }
                for b in range(len(self.texts))
            ],
        }
