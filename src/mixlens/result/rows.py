"""The per-input store of a result: a ragged store of each input's rows, held in per-batch blocks padded only to
their batch's longest input (`InputRows`), and the bias part of the norm output, built from its per-token scales
when read (`InputBiasRows`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mixlens.errors import MixlensError

TOKEN_AXES = ("target", "source", "token")


class InputRows:
    """A ragged store of each input's rows, held per batch: block k holds the inputs `parts[k][0]` (original input
    numbers) as an array [rows, *dims] whose token axes are padded only to the longest input of that block, so memory
    follows the work, not the longest input of the whole call. `lengths[b]` is the number of real tokens of input b."""

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
    def of(cls, values: np.ndarray, dims: tuple[str, ...], lengths: list[int]) -> InputRows:
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
    ) -> InputRows:
        """Rows from untrusted arrays (a loaded file): every input exactly once, float values with one row per
        input number, token axes as long as the block's longest input, other axes equal in every block
        (`validation.check_rows`)."""
        from mixlens.result.validation import check_rows

        check_rows(parts, dims, lengths, what, rows)
        return cls(parts, dims, lengths)

    @classmethod
    def concat(cls, stores: Sequence[InputRows], lengths: list[int]) -> InputRows:
        """The blocks of several stores one after the other (input numbers shifted)."""
        parts, offset = [], 0
        for s in stores:
            parts += [(i + offset, a) for i, a in s.parts]
            offset += len(s.lengths)
        return cls(parts, stores[0].dims, lengths)

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored blocks."""
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

    def map(self, fn: Callable[[np.ndarray], np.ndarray], dims: tuple[str, ...]) -> InputRows:
        """Apply `fn` to every block (axes [rows, *self.dims] → [rows, *dims])."""
        return InputRows([(i, fn(a)) for i, a in self.parts], dims, self.lengths)

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
    ) -> InputRows:
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


class InputBiasRows(InputRows):
    """The bias part of the norm output, g_i(b_O) + β = P(b_O) / s_i + β: [rows, layer, target, hidden] per block,
    built when read from what is stored, the per-token scale s_i (`scale`, an InputRows of [layer, target], 0 at
    padding) and the per-layer `terms` [layer, 2, hidden] (P(b_O), β). Holds L·n instead of L·n·d floats per
    input."""

    def __init__(self, scale: InputRows, terms: np.ndarray):
        self.scale, self.terms = scale, terms
        self.dims, self.lengths = ("layer", "target", "hidden"), scale.lengths
        self._where, self._full = scale._where, None

    def _bias(self, s: np.ndarray) -> np.ndarray:
        """[rows, L, n] scales → [rows, L, n, d] bias, 0 at padding."""
        inv = np.divide(1, s, out=np.zeros_like(s), where=s > 0)
        return (inv[..., None] * self.terms[:, 0, None] + self.terms[:, 1, None]) * (s > 0)[..., None]

    @property
    def parts(self) -> list[tuple[np.ndarray, np.ndarray]]:  # type: ignore[override]
        """The blocks as (input numbers, `[rows, layer, target, hidden]` bias), built from the scales."""
        return [(i, self._bias(s)) for i, s in self.scale.parts]

    @property
    def nbytes(self) -> int:
        """Bytes held by the scales and the per-layer terms."""
        return self.scale.nbytes + self.terms.nbytes

    def row(self, b: int) -> np.ndarray:
        """Input b without padding: `[layer, target, hidden]` bias."""
        return self._bias(self.scale.row(b)[None])[0]

    @classmethod
    def concat(cls, stores: Sequence[InputRows], lengths: list[int]) -> InputRows:
        """Lazy again when every store is an InputBiasRows of the same per-layer terms."""
        if all(isinstance(s, InputBiasRows) for s in stores):
            lazy = [s for s in stores if isinstance(s, InputBiasRows)]
            if all(np.array_equal(s.terms, lazy[0].terms) for s in lazy):
                return cls(InputRows.concat([s.scale for s in lazy], lengths), lazy[0].terms)
        return InputRows.concat(stores, lengths)
