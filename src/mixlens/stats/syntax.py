"""Syntax heads (Clark et al. 2019, §4): does a head's most-attended word follow the dependency tree?

Words and alignment. A CoNLL-U sentence is read as its basic-tree *syntactic* words (multi-word token
lines `3-4` and empty nodes `5.1` are skipped, so "don't" gives the words "do" and "n't", each a tree
node). The word forms are given to the tokenizer as pre-split words (`is_split_into_words=True`), so the
tokenizer's word id of every piece IS the UD word index — no string matching. A form the tokenizer turns
into no piece (rare: control characters) and words cut off by truncation are left out of the scores.

Word-level maps (docs/DESIGN.md §3.8): attention *to* a word is the sum over its pieces, *from* a word the mean
over its pieces: W = F A Sᵀ with S [words, tokens] the 0/1 piece matrix and F = S row-normalised. Columns
of special tokens are dropped (the argmax over words does not change).

Scores, per head and relation (the universal relation, subtypes folded: `nsubj:pass` → `nsubj`):

- `dep→head`: the dependent's most-attended other word is its head;
- `head→dep`: the head's most-attended other word is the dependent.

Baseline: the best fixed offset k ∈ [−5, 5] \\ {0} per relation and direction (predict word i + k).
Root arcs are not scored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from mixlens.errors import MixlensError
from mixlens.protocol import LensLike
from mixlens.stats.heads import view_maps

DIRECTIONS = ("dep→head", "head→dep")
OFFSETS = tuple(k for k in range(-5, 6) if k)


@dataclass
class UdSentence:
    words: list[str]
    heads: list[int]  # 0-based index of each word's head, −1 for the root
    relations: list[str]


def read_conllu(path: str | Path, limit: int | None = None) -> Iterator[UdSentence]:
    """Basic dependency trees of a CoNLL-U file (syntactic words only)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise MixlensError(f"CoNLL-U file '{path}' does not exist")
    words: list[str] = []
    heads: list[int] = []
    rels: list[str] = []
    count = 0
    with p.open("rb") as fh:
        for no, data in enumerate(fh, start=1):
            try:
                line = data.decode("utf-8-sig" if no == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise MixlensError(f"{path}: line {no} is not valid UTF-8 (CoNLL-U files are UTF-8)") from None
            if not line.strip():
                if words:
                    yield UdSentence(words, heads, rels)
                    count += 1
                    if limit is not None and count >= limit:
                        return
                words, heads, rels = [], [], []
                continue
            if line.startswith("#"):
                continue
            cols = line.split("\t")
            if len(cols) != 10:
                raise MixlensError(f"{path}: line {no} has {len(cols)} fields, CoNLL-U needs 10")
            if "-" in cols[0] or "." in cols[0]:
                continue
            try:
                idx, head = int(cols[0]), int(cols[6])
            except ValueError:
                raise MixlensError(f"{path}: line {no} has a non-numeric ID or HEAD") from None
            if idx != len(words) + 1:
                raise MixlensError(f"{path}: line {no}: word IDs are not consecutive")
            words.append(cols[1])
            heads.append(head - 1)
            rels.append(cols[7].split(":")[0])
    if words and (limit is None or count < limit):
        yield UdSentence(words, heads, rels)
        count += 1
    if count == 0:
        raise MixlensError(f"{path} holds no sentences")


def word_maps(maps: torch.Tensor, word_ids: list[int | None], n_words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token maps of one input [..., n, n] → word maps [..., W, W] (to = sum, from = mean over pieces) and a
    [W] bool of words that have at least one piece."""
    n = maps.shape[-1]
    s = torch.zeros(n_words, n, dtype=maps.dtype)
    for t, w in enumerate(word_ids[:n]):
        if w is not None:
            s[w, t] = 1.0
    has = s.sum(1) > 0
    frm = s / s.sum(1, keepdim=True).clamp_min(1)
    return frm @ maps @ s.T, has


def seen_words(word_ids: list[int | None], n: int, n_words: int) -> int:
    """How many leading words of an input the model sees (its first `n` tokens): word maps are sized by this, not
    by the whole text (a 3,000-word record cut to 512 tokens is a few hundred words, not a 3,000² map)."""
    ids = [w for w in word_ids[:n] if w is not None]
    return min(n_words, max(ids) + 1) if ids else 0


def predicted_words(wmap: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """Most-attended OTHER word (with pieces) for each word: wmap [..., W, W] → [..., W] long."""
    w = wmap.clone()
    w.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))
    w[..., ~has] = float("-inf")
    return w.argmax(-1)


@dataclass
class SyntaxReport:
    """`scores`: one row per (relation, direction, layer, head) with `accuracy`; `baselines`: per
    (relation, direction) the best fixed offset and its accuracy; `counts`: scored arcs per relation."""

    scores: pd.DataFrame
    baselines: pd.DataFrame
    counts: dict[str, int]
    n_sentences: int

    def best(self, min_count: int = 1) -> pd.DataFrame:
        """The best head per relation and direction, beside the offset baseline."""
        s = self.scores[self.scores["relation"].map(self.counts) >= min_count]
        top = s.loc[s.groupby(["relation", "direction"])["accuracy"].idxmax()]
        out = top.merge(self.baselines, on=["relation", "direction"])
        out.insert(2, "count", out["relation"].map(self.counts))
        return out.sort_values(["count", "relation", "direction"], ascending=[False, True, True]).reset_index(drop=True)


def syntax_heads(
    lens: LensLike,
    sentences: list[UdSentence],
    *,
    view: str = "attn",
    batch_size: int = 32,
    max_length: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> SyntaxReport:
    """Dependency accuracy of every head (and offset baselines) over UD `sentences`."""

    if not sentences:
        raise MixlensError("no sentences given")
    correct: dict[str, np.ndarray] = {}  # rel → [2, L, H]
    base: dict[str, np.ndarray] = {}  # rel → [2, len(OFFSETS)]
    counts: dict[str, int] = {}
    for bt in lens.batches([s.words for s in sentences], max(1, batch_size), max_length, trace=["attention"]):
        assert bt.trace is not None  # a traced batch
        batch, tokens, words = [sentences[k] for k in bt.index], bt.enc.tokens, bt.enc.words
        with torch.no_grad():
            maps = view_maps(bt.trace, view).cpu()
        for b, sent in enumerate(batch):
            n = len(tokens[b])
            seen = seen_words(words[b], n, len(sent.words))  # words past the token limit are not scored
            wmap, has = word_maps(maps[b, :, :, :n, :n], words[b], seen)
            pred = predicted_words(wmap, has).numpy()  # [L, H, W]
            for d, (h, rel) in enumerate(zip(sent.heads, sent.relations, strict=True)):
                if h < 0 or d >= seen or h >= seen or not (has[d] and has[h]):
                    continue
                if rel not in correct:
                    correct[rel] = np.zeros((2, *pred.shape[:2]))
                    base[rel] = np.zeros((2, len(OFFSETS)))
                    counts[rel] = 0
                counts[rel] += 1
                correct[rel][0] += pred[:, :, d] == h
                correct[rel][1] += pred[:, :, h] == d
                base[rel][0] += [h - d == k for k in OFFSETS]
                base[rel][1] += [d - h == k for k in OFFSETS]
        if on_batch:
            on_batch(len(batch))
    n_layers, n_heads = next(iter(correct.values())).shape[1:] if correct else (0, 0)
    if not counts:
        raise MixlensError("no dependency arcs could be scored")
    rows, brows = [], []
    for rel in sorted(counts):
        acc = correct[rel] / counts[rel]
        for k, direction in enumerate(DIRECTIONS):
            for layer in range(n_layers):
                for head in range(n_heads):
                    rows.append((rel, direction, layer, head, acc[k, layer, head]))
            best = int(base[rel][k].argmax())
            brows.append((rel, direction, OFFSETS[best], base[rel][k, best] / counts[rel]))
    return SyntaxReport(
        pd.DataFrame(rows, columns=["relation", "direction", "layer", "head", "accuracy"]),
        pd.DataFrame(brows, columns=["relation", "direction", "baseline_offset", "baseline_accuracy"]),
        counts,
        len(sentences),
    )
