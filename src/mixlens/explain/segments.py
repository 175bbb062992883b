"""Segments of an input — chat messages, custom character spans, marker-led sections, separated passages — and
their scores: each segment's score is the exact sum of its tokens' scores.

A segmentation is a list of disjoint character ranges of one text and the tokens of that text (with their
character offsets, from a fast tokenizer). A token belongs to the segment its characters overlap most (ties: the
earlier one); tokens overlapping no segment (a chat template's own tokens, special tokens, separators) belong to
none and are reported as `outside`. Segments therefore cover contiguous, disjoint token ranges, and
sum(segment scores) + sum(outside scores) = sum(token scores).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mixlens.errors import MixlensError
from mixlens.result.segmented import Segment


@dataclass(frozen=True)
class Segmentation:
    """A text, its token ids, each token's character offsets and the segments; `outside` are the indices of the
    tokens in no segment."""

    text: str
    input_ids: list[int]
    offsets: list[tuple[int, int]]
    segments: list[Segment]

    @property
    def outside(self) -> np.ndarray:
        """Indices of the tokens in no segment, ascending."""
        inside = np.zeros(len(self.input_ids), bool)
        for s in self.segments:
            inside[s.start : s.end] = True
        return np.flatnonzero(~inside)

    @property
    def labels(self) -> list[str]:
        """The segments' labels, in order."""
        return [s.label for s in self.segments]

    def membership(self) -> np.ndarray:
        """[source, segment] 0/1: token i belongs to segment j (each row has at most one 1)."""
        m = np.zeros((len(self.input_ids), len(self.segments)))
        for j, s in enumerate(self.segments):
            m[s.start : s.end, j] = 1.0
        return m

    def scores(self, token_scores: np.ndarray) -> np.ndarray:
        """Token scores [..., source] (source = this segmentation's tokens) → segment scores [..., segment]: each
        the sum of its tokens' scores, accumulated in float64."""
        x = np.asarray(token_scores, dtype=np.float64)
        if x.shape[-1] != len(self.input_ids):
            raise MixlensError(f"{x.shape[-1]} token scores for a segmentation of {len(self.input_ids)} tokens")
        return np.stack([x[..., s.start : s.end].sum(-1) for s in self.segments], axis=-1)

    def outside_score(self, token_scores: np.ndarray) -> np.ndarray:
        """The summed score of the tokens in no segment, [...]."""
        return np.asarray(token_scores, dtype=np.float64)[..., self.outside].sum(-1)

    def ranked(self, token_scores: np.ndarray) -> list[tuple[str, float]]:
        """(label, score) of each segment for one input's token scores [source], highest first (stable)."""
        s = self.scores(token_scores)
        order = np.argsort(-s, kind="stable")
        return [(self.segments[j].label, float(s[j])) for j in order]


def _encode(tokenizer, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
    if not getattr(tokenizer, "is_fast", False):
        raise MixlensError("segments need a fast tokenizer (character offsets); this one is a slow tokenizer")
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]


def check_ranges(text: str, ranges: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The character ranges (label, start, end), sorted, each non-empty and inside `text`, no two overlapping."""
    ranges = sorted(ranges, key=lambda r: (r[1], r[2]))
    for label, a, b in ranges:
        if not (0 <= a < b <= len(text)):
            raise MixlensError(f"span '{label}' [{a}, {b}) is outside the text of {len(text)} characters or empty")
    for (l1, _, b1), (l2, a2, _) in zip(ranges, ranges[1:], strict=False):
        if a2 < b1:
            raise MixlensError(f"spans '{l1}' and '{l2}' overlap; give disjoint spans")
    return ranges


def labelled_spans(ranges: Sequence[tuple[int, int] | tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Character ranges (start, end), labelled 'span k' (from 1), or (label, start, end) as given."""
    labelled = []
    for k, r in enumerate(ranges, 1):
        if len(r) == 2:
            labelled.append((f"span {k}", int(r[0]), int(r[1])))
        elif len(r) == 3:
            labelled.append((str(r[0]), int(r[1]), int(r[2])))
        else:
            raise MixlensError(f"span {k} must be (start, end) or (label, start, end), got {r!r}")
    return labelled


def check_text(
    text: str,
    ranges: Sequence[tuple[int, int]] | None = None,
    marks: Sequence[str] | None = None,
    separator: str | None = None,
) -> None:
    """The checks of a segment request that need only the text (before a model loads): spans inside it and disjoint,
    every marker and the separator non-empty and found in it."""
    if ranges:
        check_ranges(text, labelled_spans(ranges))
    for m in marks or []:
        if not m:
            raise MixlensError("markers must be non-empty strings")
        if m not in text:
            raise MixlensError(f"marker '{m}' does not occur in the text")
    if separator is not None:
        if not separator:
            raise MixlensError("the separator must be a non-empty string")
        if separator not in text:
            raise MixlensError(f"separator {separator!r} does not occur in the text")


def segmentation(
    tokenizer, text: str, ranges: Sequence[tuple[str, int, int]], *, add_special_tokens: bool = True
) -> Segmentation:
    """Segments of `text` at the character ranges (label, start, end) (disjoint, inside the text; sorted here) over
    its tokens (the model's special tokens added where `add_special_tokens`)."""
    ranges = check_ranges(text, ranges)
    ids, offsets = _encode(tokenizer, text, add_special_tokens)
    owner = np.full(len(ids), -1)
    for i, (ta, tb) in enumerate(offsets):
        best = 0
        for j, (_, a, b) in enumerate(ranges):
            overlap = min(tb, b) - max(ta, a)
            if overlap > best:
                best, owner[i] = overlap, j
    segments = []
    for j, (label, a, b) in enumerate(ranges):
        mine = np.flatnonzero(owner == j)
        start, end = (int(mine[0]), int(mine[-1]) + 1) if len(mine) else (0, 0)
        if len(mine) and end - start != len(mine):  # cannot happen for disjoint sorted ranges; guard the invariant
            raise MixlensError(f"span '{label}' does not cover contiguous tokens")
        segments.append(Segment(label, a, b, start, end))
    return Segmentation(text, ids, offsets, segments)


def spans(tokenizer, text: str, ranges: Sequence[tuple[int, int] | tuple[str, int, int]], **kw: bool) -> Segmentation:
    """Custom segments: character ranges (start, end) (labelled 'span k', from 1) or (label, start, end)."""
    return segmentation(tokenizer, text, labelled_spans(ranges), **kw)


def markers(tokenizer, text: str, marks: Sequence[str], **kw: bool) -> Segmentation:
    """Segments that each start at an occurrence of one of the marker strings and run to the next occurrence (or the
    end of the text); the text before the first marker is in no segment. Labels: the marker and its occurrence
    number ('Doc: #2')."""
    if not marks or any(not m for m in marks):
        raise MixlensError("markers must be non-empty strings")
    starts: list[tuple[int, str]] = []
    for m in dict.fromkeys(marks):
        found, at = 0, text.find(m)
        while at >= 0:
            found += 1
            starts.append((at, m))
            at = text.find(m, at + len(m))
        if not found:
            raise MixlensError(f"marker '{m}' does not occur in the text")
    starts.sort()
    for (a1, m1), (a2, m2) in zip(starts, starts[1:], strict=False):
        if a2 < a1 + len(m1):
            raise MixlensError(f"markers '{m1}' and '{m2}' overlap at character {a2}")
    counts: dict[str, int] = {}
    ranges = []
    for k, (a, m) in enumerate(starts):
        counts[m] = counts.get(m, 0) + 1
        end = starts[k + 1][0] if k + 1 < len(starts) else len(text)
        ranges.append((f"{m.strip() or repr(m)} #{counts[m]}", a, end))
    return segmentation(tokenizer, text, ranges, **kw)


def passages(tokenizer, text: str, separator: str, **kw: bool) -> Segmentation:
    """The passages of `text` split at `separator` ('passage k', from 1), each without its surrounding whitespace;
    empty passages are dropped; separators and whitespace between passages belong to no segment."""
    if not separator:
        raise MixlensError("the separator must be a non-empty string")
    if separator not in text:
        raise MixlensError(f"separator {separator!r} does not occur in the text")
    ranges: list[tuple[str, int, int]] = []
    at = 0
    for part in text.split(separator):
        a = at + (len(part) - len(part.lstrip()))
        b = at + len(part.rstrip())
        if b > a:
            ranges.append((f"passage {len(ranges) + 1}", a, b))
        at += len(part) + len(separator)
    return segmentation(tokenizer, text, ranges, **kw)


def read_chat(source: str | Path) -> list[dict[str, str]]:
    """A conversation — a JSON list of {"role", "content"} messages — from a file or a JSON string (one starting
    with '[')."""
    if isinstance(source, str) and source.lstrip().startswith("["):
        raw, where = source, "the chat"
    else:
        path = Path(source)
        if not path.is_file():
            raise MixlensError(f"chat file '{path}' does not exist or is not a file")
        raw, where = path.read_text(encoding="utf-8"), f"chat file '{path}'"
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise MixlensError(f"{where} is not valid JSON: {e.msg} (line {e.lineno})") from None
    return check_messages(doc, where)


def check_messages(doc: object, where: str = "the chat") -> list[dict[str, str]]:
    """`doc` as a list of messages, or a MixlensError naming what is wrong."""
    if not isinstance(doc, list) or not doc:
        raise MixlensError(f'{where} must be a non-empty JSON list of {{"role": ..., "content": ...}} messages')
    for k, m in enumerate(doc, 1):
        if not isinstance(m, dict):
            raise MixlensError(f'{where}: message {k} is not a {{"role": ..., "content": ...}} object')
        for key in ("role", "content"):
            if key not in m:
                raise MixlensError(f"{where}: message {k} has no '{key}'")
            if not isinstance(m[key], str):
                raise MixlensError(f"{where}: message {k}'s {key} is {type(m[key]).__name__}, not a string")
        if not m["role"].strip() or not m["content"].strip():
            raise MixlensError(f"{where}: message {k} has an empty role or content")
    return [{"role": m["role"], "content": m["content"]} for m in doc]


SENTINEL = "MIXLENS-SEGMENT-SENTINEL"


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja2's TemplateError (raise_exception in the template) and the like
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        k = _first_rejected(tokenizer, messages)
        which = "this conversation" if k is None else f"message {k + 1} (role '{messages[k]['role']}')"
        raise MixlensError(f"the model's chat template rejects {which}: {msg}") from None
    return str(out)


def _first_rejected(tokenizer, messages: list[dict[str, str]]) -> int | None:
    """The first message whose conversation so far the chat template refuses to render (an unknown role, turns that
    do not alternate), or None where every beginning renders (the whole is refused)."""
    for k in range(len(messages)):
        try:
            tokenizer.apply_chat_template(messages[: k + 1], tokenize=False, add_generation_prompt=False)
        except Exception:
            return k
    return None


def chat(tokenizer, messages: Sequence[dict[str, str]], *, generation_prompt: bool = True) -> Segmentation:
    """The conversation rendered by the tokenizer's chat template (with the assistant's generation prompt where
    `generation_prompt`), one segment per message ('k role', from 1) over the characters of its content; the
    template's own text (role headers, end-of-turn tokens, a default system prompt) belongs to no message. The
    rendered text is tokenized as is (its special tokens come from the template)."""
    if not getattr(tokenizer, "chat_template", None):
        raise MixlensError("this model's tokenizer has no chat template; --chat needs a chat (instruct) model")
    messages = check_messages(list(messages))
    text = _render(tokenizer, messages, generation_prompt)
    ranges, cursor = [], 0
    for k, m in enumerate(messages):
        # where message k's content starts: the place of a sentinel rendered in its stead (so that a word of a
        # default system prompt or of an earlier turn is not taken for it), checked against the real text
        probe = _render(tokenizer, [*messages[:k], {**m, "content": SENTINEL}, *messages[k + 1 :]], generation_prompt)
        at = probe.find(SENTINEL)
        for content in (m["content"], m["content"].strip()):  # templates that strip the content
            if at >= cursor and text.startswith(content, at):
                break
        else:
            content, at = m["content"], -1
        if at < 0:  # the template's text depends on the content: the first occurrence after the last message
            at = text.find(content, cursor)
            if at < 0:
                content = content.strip()
                at = text.find(content, cursor)
        if at < 0:
            raise MixlensError(
                f"the chat template leaves out or rewrites message {k + 1} (role '{m['role']}'): "
                "a role it does not know?"
            )
        ranges.append((f"{k + 1} {m['role']}", at, at + len(content)))
        cursor = at + len(content)
    return segmentation(tokenizer, text, ranges, add_special_tokens=False)
