"""Tokenising and batching: inputs checked and tokenized once (texts, sentence pairs or pre-split words), cut
into right-padded batches (`Encoded`), and the `Batch` that `Lens.batches` yields."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mixlens.errors import MixlensError
from mixlens.texts import has_visible
from mixlens.trace import Trace

Text = str | tuple[str, str]  # a single text or a sentence pair


@dataclass
class Encoded:
    """A tokenized, right-padded batch with per-input token strings and word ids."""

    inputs: dict[str, torch.Tensor]  # input_ids, attention_mask (, token_type_ids): [batch, n]
    tokens: list[list[str]]
    words: list[list[int | None]]
    truncated: list[int]  # original length of each truncated input (0 if not truncated)


@dataclass
class Batch:
    """One batch of `Lens.batches`: `index[k]` is the position in the call's inputs of the batch's input k."""

    index: list[int]
    enc: Encoded
    trace: Trace | None  # one forward pass, when asked for


def check_max_length(tokenizer: Any, limit: int, pair: bool) -> None:
    """Refuse a token limit below what the special tokens and one token of each text need."""
    need = tokenizer.num_special_tokens_to_add(pair=pair) + (2 if pair else 1)
    if limit < need:
        raise MixlensError(
            f"max_length {limit} is too short: this model needs at least {need} tokens per "
            f"input ({need - (2 if pair else 1)} special)"
        )


class Tokenized:
    """Inputs tokenized once, without padding: ids, token type ids, word ids and original lengths per input."""

    def __init__(self, tok: Any, texts: list[Text | list[str]], limit: int, truncate: bool, model_limit: int):
        """`limit`: this call's token limit; `model_limit`: the model's (what raising the limit could reach)."""
        split = isinstance(texts[0], list)
        firsts = [t[0] if isinstance(t, tuple) else t for t in texts]
        pairs = [t[1] for t in texts] if isinstance(texts[0], tuple) else None
        check_max_length(tok, limit, pairs is not None)
        enc = tok(firsts, pairs, truncation=False, is_split_into_words=split)
        self.ids: list[list[int]] = enc["input_ids"]
        self.types: list[list[int]] | None = enc.get("token_type_ids")
        self.words = [enc.word_ids(b) for b in range(len(texts))]
        self.lengths = [len(x) for x in self.ids]
        self.truncated = [n if n > limit else 0 for n in self.lengths]
        over = [b for b, n in enumerate(self.lengths) if n > limit]
        if over and not truncate:
            b = over[0]
            if limit >= model_limit:  # raising --max-length cannot help: the model reads no more
                raise MixlensError(
                    f"input {b + 1} has {self.lengths[b]} tokens, more than the model's position limit of {limit} "
                    "tokens (allow truncation to cut it, or use a model with a longer context)"
                )
            raise MixlensError(
                f"input {b + 1} has {self.lengths[b]} tokens, more than the limit of {limit} "
                f"(allow truncation or raise --max-length, up to the model's {model_limit})"
            )
        if over:  # the rare over-long inputs once more, cut the tokenizer's way (pairs: longest first)
            cut = tok(
                [firsts[b] for b in over],
                [pairs[b] for b in over] if pairs is not None else None,
                truncation=True,
                max_length=limit,
                is_split_into_words=split,
            )
            for k, b in enumerate(over):
                self.ids[b] = cut["input_ids"][k]
                if self.types is not None:
                    self.types[b] = cut["token_type_ids"][k]
                self.words[b] = cut.word_ids(k)
                self.lengths[b] = len(self.ids[b])

    @classmethod
    def from_ids(cls, ids: Sequence[Sequence[int]]) -> Tokenized:
        """Inputs given as token ids (e.g. a text with generated tokens, or a perturbed input): single segments."""
        self = cls.__new__(cls)
        self.ids = [list(x) for x in ids]
        self.types = None
        self.words = [[None] * len(x) for x in self.ids]
        self.lengths = [len(x) for x in self.ids]
        self.truncated = [0] * len(self.ids)
        return self

    @classmethod
    def restore(
        cls,
        ids: Sequence[Sequence[int]],
        types: Sequence[Sequence[int]] | None,
        words: Sequence[Sequence[int | None]],
        truncated: Sequence[int],
    ) -> Tokenized:
        """Inputs tokenized elsewhere (a corpus run's tokenizing stage): the `ids`, `types`, `words` and `truncated`
        lists a `Tokenized` built from texts holds, so that batches of it are the same."""
        self = cls.__new__(cls)
        self.ids = [list(x) for x in ids]
        self.types = [list(x) for x in types] if types is not None else None
        self.words = [list(x) for x in words]
        self.lengths = [len(x) for x in self.ids]
        self.truncated = list(truncated)
        return self

    def batch(self, tokenizer: Any, device: torch.device, rows: Sequence[int]) -> Encoded:
        """The inputs `rows` as one right-padded batch on `device` (the model's)."""
        n = max(self.lengths[b] for b in rows)
        ids = np.full((len(rows), n), tokenizer.pad_token_id, np.int64)
        mask = np.zeros((len(rows), n), np.int64)
        types = np.full((len(rows), n), tokenizer.pad_token_type_id, np.int64) if self.types else None
        if types is None and "token_type_ids" in tokenizer.model_input_names:  # ids: one segment
            types = np.zeros((len(rows), n), np.int64)
        for k, b in enumerate(rows):
            m = self.lengths[b]
            ids[k, :m], mask[k, :m] = self.ids[b], 1
            if types is not None and self.types is not None:
                types[k, :m] = self.types[b]
        inputs = {"input_ids": ids, "attention_mask": mask} | ({"token_type_ids": types} if types is not None else {})
        convert = tokenizer.convert_ids_to_tokens
        return Encoded(
            {k: torch.from_numpy(v).to(device) for k, v in inputs.items()},
            [convert(self.ids[b]) for b in rows],
            [self.words[b] for b in rows],
            [self.truncated[b] for b in rows],
        )


def text_of(t: Text | list[str]) -> str:
    """An input as one text (a pair joined by [PAIR], words by spaces)."""
    return t if isinstance(t, str) else " [PAIR] ".join(t) if isinstance(t, tuple) else " ".join(t)


def check_texts(texts: Sequence[Text | list[str]]) -> list[Text | list[str]]:
    """The inputs of one call, refused in one line when empty, mixed or without a visible character."""
    texts = list(texts)
    if not texts:
        raise MixlensError("no input text given")
    kinds = {type(t) for t in texts}
    if len(kinds) > 1:
        raise MixlensError("mix of single texts, sentence pairs and word lists in one call")
    for k, t in enumerate(texts):
        if isinstance(t, list):  # pre-split words
            if not all(isinstance(w, str) for w in t) or not any(has_visible(w) for w in t):
                raise MixlensError(f"input {k + 1} is an empty word list or holds no visible word")
            continue
        parts = t if isinstance(t, tuple) else (t,)
        if any(not isinstance(p, str) or not has_visible(p) for p in parts):
            raise MixlensError(f"input {k + 1} is empty or whitespace only")
    return texts
