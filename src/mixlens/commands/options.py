"""Options and input handling shared by the commands.

Only the standard library, typer and `mixlens.errors` load here: every command's signature is built from
these at start-up, and `mixlens --help` must not pay for torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import typer

from mixlens.errors import MixlensError


def model_option() -> Any:
    """`--model/-m`: a local HF model directory or hub id."""
    return typer.Option(
        None, "--model", "-m", help="Local HF model directory or hub id (default: bundled all-MiniLM-L6-v2)."
    )


def data_option() -> Any:
    return typer.Option(..., "--data", "-d", help="TSV/CSV/JSONL/Parquet/plain-text file.")


def text_column_option() -> Any:
    return typer.Option(None, "--text-column", help="Column holding the text (default: sentence/text/...).")


def pair_column_option() -> Any:
    return typer.Option(None, "--pair-column", help="Column holding the second text of a pair.")


def limit_option() -> Any:
    return typer.Option(None, "--limit", "-n", help="Use only the first N examples.")


def batch_size_option() -> Any:
    return typer.Option(32, "--batch-size", min=1, help="Inputs per forward pass.")


def parse_options(items: Sequence[str] | None) -> dict[str, dict[str, object]]:
    """`--option METHOD.KEY=VALUE` (VALUE as JSON, else a string) → {method: {key: value}}."""
    out: dict[str, dict[str, object]] = {}
    for item in items or []:
        name, eq, raw = item.partition("=")
        method, dot, key = name.partition(".")
        if not (eq and dot and method and key):
            raise MixlensError(f"bad --option '{item}'; expected METHOD.KEY=VALUE, e.g. globenc_rollout.normalize=true")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(method, {})[key] = value
    return out


def check_methods(given: Sequence[str] | None) -> list[str]:
    """The requested method names (default: `mixlens.lens.DEFAULT_METHODS`); unknown names fail before any model
    loads."""
    from mixlens.lens import DEFAULT_METHODS
    from mixlens.methods import get

    methods = list(given) if given else list(DEFAULT_METHODS)
    for m in methods:
        get(m)
    return methods


def check_view(view: str) -> str:
    from mixlens.stats.heads import VIEWS

    if view not in VIEWS:
        raise MixlensError(f"unknown view '{view}'; valid: {', '.join(VIEWS)}")
    return view


def check_limit(limit: int | None) -> int | None:
    if limit is not None and limit < 1:
        raise MixlensError("--limit must be at least 1")
    return limit


def read_examples(data: str, text_column: str | None, pair_column: str | None, limit: int | None) -> list[Any]:
    """The first `limit` examples of a data file (through the shared corpus readers)."""
    from mixlens.corpus.readers import iter_examples

    out: list[Any] = []
    for ex in iter_examples(data, text_column, pair_column):
        if limit is not None and len(out) >= limit:
            break
        out.append(ex)
    return out


def quiet_libraries() -> None:
    """Library chatter (hub retries, progress bars) would bury our one-line messages."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("huggingface_hub").setLevel(logging.CRITICAL)


def disable_option() -> Any:
    """`--disable L5H8,L0H9`: heads disabled throughout the command (zero ablation = what pruning them computes;
    apply with `mixlens.interventions.disabled(lens, spec)`)."""
    return typer.Option(
        None, "--disable", help="Heads to disable throughout, as if pruned (z ← 0), e.g. L5H8,L0H9; L3 = whole layer."
    )
