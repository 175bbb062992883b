"""`LensLike`: what the layers above the lens (explain, evaluate, the statistics, the studies, the commands) use of a
`mixlens.Lens`, as a typed protocol in a module below them, so that they take a lens without importing `lens.py`
and nothing passes it as `Any`. `mixlens.Lens` satisfies it (checked by mypy where a Lens is passed)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

from mixlens.adapters import Adapter
from mixlens.batching import Batch, Encoded, Text
from mixlens.pipeline import NOT_GIVEN, LayerProgress, NotGiven, Rows
from mixlens.result import Analysis
from mixlens.trace import Edit, FfnCapture, Trace


class LensLike(Protocol):
    """A model ready for analysis: the transformers model and tokenizer, its adapter and name, and the lens's
    batching, tracing and analysis calls (see `mixlens.lens.Lens` for what each does)."""

    model: Any  # a transformers model: its attributes (config, heads) are dynamic
    tokenizer: Any
    adapter: Adapter
    name: str

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def max_length(self) -> int: ...

    def special_roles(self, ids: Iterable[int]) -> list[str | None]: ...

    def limit(self, max_length: int | None = None) -> int: ...

    def encode(
        self, texts: Sequence[Text | list[str]], max_length: int | None = None, truncate: bool = True
    ) -> Encoded: ...

    def encode_ids(self, ids: Sequence[Sequence[int]]) -> Encoded: ...

    def batches(
        self,
        texts: Sequence[Text | list[str]],
        batch_size: int = 32,
        max_length: int | None = None,
        *,
        truncate: bool = True,
        order: str = "input",
        max_tokens: int | None = None,
        max_cells: int | None = None,
        trace: bool | Sequence[str] = False,
        rows: Rows = None,
        output: bool = False,
        on_layer: LayerProgress | None = None,
    ) -> Iterator[Batch]: ...

    def trace_for(
        self,
        enc: Encoded,
        trace: bool | Sequence[str] = True,
        rows: Rows = None,
        output: bool = False,
        on_layer: LayerProgress | None = None,
        logit_at: torch.Tensor | None = None,
    ) -> Trace: ...

    def trace(
        self,
        enc: Encoded | Sequence[Text],
        edits: dict[str, Edit] | None = None,
        ffn: FfnCapture = False,
        to_output: bool = True,
        qk_rows: bool = False,
        head: bool = True,
    ) -> Trace: ...

    def analyze(
        self,
        texts: Text | Sequence[Text | list[str]],
        methods: Sequence[str] | None = None,
        *,
        heads: bool = False,
        batch_size: int = 32,
        max_length: int | None = None,
        truncate: bool = True,
        options: dict[str, dict[str, object]] | None = None,
        on_batch: Callable[[int], None] | None = None,
        rows: Rows = "auto",
        on_layer: LayerProgress | None = None,
        targets: Rows | NotGiven = NOT_GIVEN,
    ) -> Analysis: ...
