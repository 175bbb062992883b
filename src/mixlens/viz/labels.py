"""Names of things in views: the model in a figure title, a token as text (no heavy imports: the commands use it at
module level)."""

from __future__ import annotations

import re
from functools import cache, lru_cache
from pathlib import Path

WORD_MARK = "▁"  # SentencePiece's word-start mark (U+2581)
NEWLINE, TAB, EMPTY = "⏎", "⇥", "∅"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback, e.g. <0x0A>


def model_label(model: str) -> str:
    """A model for a figure title: a local path or hub id by its last part (the folder, not the whole path)."""
    return Path(str(model).rstrip("/")).name or str(model)


@cache
def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte → printable character table (GPT-2, RoBERTa, Llama 3, Qwen, SmolLM):
    printable Latin-1 bytes stand for themselves, the other 68 bytes (space, control, ...) for U+0100 onwards
    (space is 'Ġ', newline 'Ċ')."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {chr(b): b for b in keep} | {chr(256 + k): b for k, b in enumerate(shifted)}


@lru_cache(maxsize=1 << 16)  # called for every token of a view; vocabularies repeat
def token_text(token: str) -> str:
    """A token as a reader sees it, in every view (terminal tables, HTML reports, figures): a byte-level BPE piece
    decoded to its text ('Ġkeys' → ' keys', 'Ċ' → newline), SentencePiece's word mark and byte pieces likewise
    ('▁keys' → ' keys', '<0x0A>' → newline); WordPiece's '##' stays (it says the piece continues a word). Newlines
    and tabs show as ⏎ and ⇥, an empty token as ∅. Text that is already readable is returned as is."""
    table = _byte_decoder()
    text = token
    if token and all(c in table for c in token):
        try:
            text = bytes(table[c] for c in token).decode("utf-8")
        except UnicodeDecodeError:  # not byte-level (a WordPiece 'é'), or a piece of a multi-byte character
            if any(c in "ĠĊĉ" for c in token):  # a byte-level space, newline or tab: byte-level for sure
                text = bytes(table[c] for c in token).decode("utf-8", errors="replace")
    text = _BYTE_PIECE.sub(lambda m: chr(int(m.group(1), 16)) if int(m.group(1), 16) < 128 else m.group(0), text)
    text = text.replace(WORD_MARK, " ").replace("\r\n", NEWLINE).replace("\n", NEWLINE).replace("\t", TAB)
    return text or EMPTY
