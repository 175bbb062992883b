"""What methods share on one trace (`Memo`, a keyed cache) and what a streaming method's layer sink sees
(`StreamLayer`). The trace has an opaque slot for the memo (`Trace.memo`) and knows no method; this module knows
none either: each method module owns the keys of what it caches (`memo.cached(KEY, make)`).
`memo_of(trace)` gives a trace's memo, made on first use."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import torch

from mixlens.trace import LayerTrace, Trace

if TYPE_CHECKING:
    from mixlens.adapters import Family, Layer

T = TypeVar("T")
RowsFn = Callable[[torch.Tensor], torch.Tensor]  # positions [B, K'] → rows [B, K', n] of one layer's matrix
LayerRowsFactory = Callable[[], RowsFn]  # builds a layer's RowsFn when a rollout reaches it (its work arrays then)
Progress = Callable[[str, int, int], None]  # (phase, layers done, layers in the phase)


def gathered(mat: torch.Tensor) -> LayerRowsFactory:
    """The factory of the rows of a whole matrix [B, n, n] held in memory."""
    return lambda: lambda rows: mat.gather(1, rows[:, :, None].expand(-1, -1, mat.shape[-1]))


class PairRows(NamedTuple):
    """Rows at positions [B, K'] of one layer's pair maps (the norm engine's), each [B, K', n] (padding rows 0)."""

    n: torch.Tensor  # ‖u_ij‖
    n_res: torch.Tensor  # ‖t_ij‖
    n_resln: torch.Tensor  # ‖g_i(t_ij)‖


@dataclass
class Memo:
    """What methods share on one trace, computed once. `rows`: the positions [B, K] of row mode
    (`run_methods(rows=)`; None: every row). A streamed trace (`pipeline.stream_trace`) also holds what its layer
    sinks kept: `streamed` (the methods they served; α is gone), `layer_rows` (quantity → per layer [B, K, n] rows;
    `alpha`: [B, H, K, n]) and `layer_fns` (quantity → per layer a factory of the function positions [B, K'] →
    rows [B, K', n] of the matrix a rollout propagates through); `progress(phase, done, total)` as layers finish.
    Everything else is a keyed cache (`cached`, `get`, `put`) whose keys belong to the method modules."""

    rows: torch.Tensor | None = None
    streamed: frozenset[str] = frozenset()
    progress: Progress | None = None
    layer_rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    layer_fns: dict[str, list[LayerRowsFactory]] = field(default_factory=dict)
    values: dict[Hashable, Any] = field(default_factory=dict)

    def cached(self, key: Hashable, make: Callable[[], T]) -> T:
        """The value under `key`, made by `make()` on first use."""
        if key not in self.values:
            self.values[key] = make()
        return cast(T, self.values[key])

    def get(self, key: Hashable) -> Any:
        """The value under `key`, or None."""
        return self.values.get(key)

    def put(self, key: Hashable, value: T) -> T:
        self.values[key] = value
        return value


def memo_of(trace: Trace) -> Memo:
    """The trace's memo, made on first use."""
    if trace.memo is None:
        trace.memo = Memo()
    memo: Memo = trace.memo
    return memo


@dataclass
class StreamLayer:
    """What a method's layer sink (`registry.Stream.sink`) sees of layer `index` while the forward pass of a streamed
    trace runs (its tensors alive in `lt`): the model's `layer` and `family`, the real-token `mask` [B, n], the
    target `rows` [B, K], and, when a requested stream asked the norm engine for it (`Stream.norm_run` and
    `whole`), the engine's N, N-Res and N-ResLN rows of this layer (`pairs`; N-Res alone: `n_res`). A sink keeps
    what its methods read afterwards with `keep` (this layer's rows [B, K, n]) or `keep_fn` (a factory of any rows,
    for a rollout). A factory must not hold `lt` or this object (the layer's tensors are freed after the sinks
    ran)."""

    index: int
    lt: LayerTrace
    layer: Layer
    family: Family
    mask: torch.Tensor
    rows: torch.Tensor
    memo: Memo
    pairs: Callable[[torch.Tensor], PairRows] | None = None  # positions [B, K'] → the pair maps' rows

    @property
    def n_res(self) -> RowsFn | None:
        """The rows of this layer's N-Res matrix (`pairs`), positions [B, K'] → [B, K', n]; None without `pairs`."""
        pairs = self.pairs
        return None if pairs is None else lambda rows: pairs(rows).n_res

    @property
    def row_mode(self) -> bool:
        """The layer keeps q and K instead of α (`run_traced(qk_rows=True)`, causal LMs)."""
        return self.lt.qk is not None

    def keep(self, key: str, t: torch.Tensor) -> None:
        got = self.memo.layer_rows.setdefault(key, [])
        assert len(got) == self.index, f"layer {self.index} streamed out of order"
        got.append(t)

    def keep_fn(self, key: str, factory: LayerRowsFactory) -> None:
        got = self.memo.layer_fns.setdefault(key, [])
        assert len(got) == self.index, f"layer {self.index} streamed out of order"
        got.append(factory)
