"""`Attribution`: the values of one method for a batch of inputs, a labelled array stored per batch."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mixlens.errors import MixlensError
from mixlens.result import views
from mixlens.result.files import (
    ANALYSIS_FORMAT,
    ATTRIBUTION_FORMAT,
    check_save_id,
    read_manifest,
    read_tensors,
    write_store,
)
from mixlens.result.rows import TOKEN_AXES, InputRows
from mixlens.result.validation import checked_dims, checked_field, checked_rows, checked_tokens, checked_words

if TYPE_CHECKING:
    import pandas as pd


class Attribution:
    """Values of one method for a batch of inputs.

    `values` has axes `("batch", *dims)`; `target`/`source` axes are padded to the longest input and
    padded entries are 0. `tokens[b]` lists the real tokens of input b (special tokens included), and
    `words[b][k]` the word index of token k (None for special tokens). Results of `Lens.analyze` are stored per
    batch (`store`, an `InputRows`); `values` is then built on first use (a convenience for small results: it pads
    every input to the longest one) — `input(b)`, `sel`, `mean`, `to_words`, `to_dataframe`, `save` never build it.
    `extra_store[name]` holds the method's secondary outputs (e.g. `delta` of integrated gradients) per input;
    `extras[name]` is the padded [batch, *axes] array.
    In row mode `rows[b]` lists the token positions of input b's rows on the `target` axis (None: all rows);
    `targets` is its deprecated name.
    """

    def __init__(
        self,
        values: np.ndarray | InputRows,
        dims: tuple[str, ...],
        tokens: list[list[str]],
        method: str,
        model: str = "",
        params: dict[str, Any] | None = None,
        words: list[list[int | None]] | None = None,
        extras: dict[str, InputRows] | None = None,
        rows: list[list[int]] | None = None,
    ):
        self.dims = tuple(dims)
        self.rows = rows
        self.tokens = tokens
        self.method = method
        self.model = model
        self.params = params or {}
        self.words = words
        self.extra_store = dict(extras or {})
        if isinstance(values, InputRows):
            self.store = values
        else:
            if values.ndim != len(self.dims) + 1:
                raise ValueError(f"values have {values.ndim} axes, dims name {len(self.dims) + 1}")
            self.store = InputRows.of(values, self.dims, self.lengths)

    @property
    def values(self) -> np.ndarray:
        """All inputs as one array `[batch, *dims]` (token axes zero-padded; built on first use)."""
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
        """Each input's token count."""
        return [len(t) for t in self.tokens]

    def __len__(self) -> int:
        return len(self.tokens)

    def _like(self, store: InputRows, dims: tuple[str, ...], params: dict[str, Any], touched: set[str]) -> Attribution:
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
            self.rows if "target" in dims else None,
        )

    @property
    def targets(self) -> list[list[int]] | None:
        """Deprecated name of `rows` (the positions of the computed rows of the `target` axis)."""
        warnings.warn("Attribution.targets is deprecated: use Attribution.rows", DeprecationWarning, stacklevel=2)
        return self.rows

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
        if self.words is None or self.dims[-2:] != ("target", "source") or self.rows is not None:
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
            InputRows(parts, self.dims, [len(g) for g in groups]),
            self.dims,
            toks,
            self.method,
            self.model,
            {**self.params, "words": True},
            [list(range(len(g))) for g in groups],
            extras,
        )

    def to_dataframe(self) -> pd.DataFrame:
        """Long table of real (non-pad) entries: one column per axis, token strings, and `value`."""
        import pandas as pd

        frames = []
        for b in range(len(self)):
            arr = self.input(b)
            grid = np.indices(arr.shape).reshape(len(self.dims), -1)
            df = pd.DataFrame({d: grid[k] for k, d in enumerate(self.dims)})
            df.insert(0, "batch", b)
            if self.rows is not None and "target" in df:  # row k → its token position
                df["target"] = np.asarray(self.rows[b])[df["target"].to_numpy()]
            for d in ("target", "source"):
                if d in df:
                    df[f"{d}_token"] = np.asarray(self.tokens[b], dtype=object)[df[d].to_numpy()]
            df["value"] = arr.reshape(-1)
            frames.append(df)
        return pd.concat(frames, ignore_index=True)

    def _repr_html_(self) -> str:
        """Interactive view in notebooks (offline; unique ids, so several outputs share a page)."""
        return str(views.view("attribution.notebook")(self))

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
        views.view("attribution.show")(self, inputs, layer=layer, head=head, max_tokens=max_tokens, console=console)

    def to_json_dict(self, b: int) -> dict[str, Any]:
        """Input `b` as JSON: its axes, values without padding, extras and (when set) its rows' positions."""
        out = {
            "dims": list(self.dims),
            "values": self.input(b).tolist(),
            "extras": {k: {"dims": list(s.dims), "values": s.row(b).tolist()} for k, s in self.extra_store.items()},
        }
        return out if self.rows is None else {**out, "rows": self.rows[b]}

    def manifest(self) -> dict[str, Any]:
        """The JSON manifest saved next to the tensors: format, method, model, axes `[batch, *dims]`, tokens and
        parameters."""
        return {
            "format": ATTRIBUTION_FORMAT,
            "method": self.method,
            "model": self.model,
            "dims": ["batch", *self.dims],
            "tokens": self.tokens,
            "words": self.words,
            "params": self.params,
            "rows": self.rows,
            "blocks": len(self.store.parts),
            "extras": {k: {"dims": list(s.dims), "blocks": len(s.parts)} for k, s in self.extra_store.items()},
        }

    def save(self, path: str | Path) -> None:
        """`path.safetensors` (per-batch blocks `values.k` with the input numbers `index.k`; extras as
        `extra.NAME.values.k` / `extra.NAME.index.k`) + `path.json` (manifest). No pickles; atomic writes."""
        tensors = self.store.tensors("")
        for k, s in self.extra_store.items():
            tensors |= s.tensors(f"extra.{k}.")
        write_store(Path(path), tensors, self.manifest())

    @classmethod
    def load(cls, path: str | Path) -> Attribution:
        """Read what `save` wrote; every field and tensor is checked (`MixlensError` on a bad or crafted file)."""
        path = Path(path)
        man_path = path.with_suffix(".json")
        man = read_manifest(man_path)
        if man.get("format") == ANALYSIS_FORMAT:
            raise MixlensError(f"{man_path} is a saved analysis: use Analysis.load")
        tokens = checked_tokens(man, man_path)
        dims = checked_dims(checked_field(man, "dims", list, man_path), man_path, "'dims'")
        if not dims or dims[0] != "batch":
            raise MixlensError(f"{man_path}: 'dims' must start with 'batch'")
        dims = dims[1:]
        method, model = checked_field(man, "method", str, man_path), checked_field(man, "model", str, man_path)
        params, words = checked_field(man, "params", dict, man_path), checked_words(man, tokens, man_path)
        extras_man = man.get("extras", {})
        if not isinstance(extras_man, dict) or not all(isinstance(e, dict) for e in extras_man.values()):
            raise MixlensError(f"{man_path}: 'extras' must map names to their axes and block counts")
        positions = checked_rows(man, tokens, man_path)
        rows = None if positions is None else [len(r) for r in positions]
        tensors, meta = read_tensors(path.with_suffix(".safetensors"))
        check_save_id(man, meta, man_path)
        lengths = [len(t) for t in tokens]
        what = f"{path.with_suffix('.safetensors')}"
        if "values" in tensors:  # one padded array (files of earlier versions)
            store = InputRows.checked([(np.arange(len(tokens)), tensors["values"])], dims, lengths, what, rows)
        else:
            count = man.get("blocks", sum(k.startswith("values.") for k in tensors))
            store = InputRows.from_tensors(tensors, "", count, dims, lengths, what, rows)
        extras = {
            k: InputRows.from_tensors(
                tensors,
                f"extra.{k}.",
                e.get("blocks"),
                checked_dims(e.get("dims"), man_path, f"extra '{k}' axes"),
                lengths,
                what,
            )
            for k, e in extras_man.items()
        }
        return cls(store, dims, tokens, method, model, params, words, extras, positions)


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
