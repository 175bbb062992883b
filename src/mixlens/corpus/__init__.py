"""Corpus runs: stream a dataset, batch it by length, run methods, write resumable Parquet shards.

The public names load on first use (PEP 562): a Ray Data read task imports `mixlens.corpus.raydata` and the readers
without torch or the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mixlens.lazy import submodule_getattr

if TYPE_CHECKING:
    from mixlens.corpus.readers import Example, ReadStats, count_records, iter_examples
    from mixlens.corpus.runner import CorpusResult, run_corpus

__all__ = ["CorpusResult", "Example", "ReadStats", "count_records", "iter_examples", "run_corpus"]
_HOME = {"CorpusResult": "runner", "run_corpus": "runner"} | dict.fromkeys(
    ["Example", "ReadStats", "count_records", "iter_examples"], "readers"
)
_submodule = submodule_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    return _submodule(name)
