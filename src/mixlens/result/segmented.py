"""An explanation's segments as part of the result: each input's segments (label, character range, token range;
`mixlens.explain.segments.Segment`) and the segment scores derived from the token scores — exact sums, so they are
never stored as numbers of their own; their JSON form, the check of a loaded one, and the answer × segment matrix.

Shapes: token scores `[..., source]` → segment scores `[..., segment]`; an answer matrix `[answer, source]` (row a:
the context tokens' scores for answer token a) → `[answer, segment + 1]`, the last column the tokens in no segment
('outside'), so that every row sums to the row of token scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mixlens.errors import MixlensError

OUTSIDE = "(outside)"  # the label of the tokens in no segment
ANSWER = "(answer)"  # the label of an explained answer's own tokens as sources (the earlier answer tokens)


@dataclass(frozen=True)
class Segment:
    """One segment: its label, its character range [char_start, char_end) in the text and its token range
    [start, end) (empty, start = end, where no token overlaps it most)."""

    label: str
    char_start: int
    char_end: int
    start: int
    end: int


def membership(segments: Sequence[Segment], n: int) -> np.ndarray:
    """[source, segment] 0/1: token i belongs to segment j (each row at most one 1)."""
    m = np.zeros((n, len(segments)))
    for j, s in enumerate(segments):
        m[s.start : s.end, j] = 1.0
    return m


def outside(segments: Sequence[Segment], n: int) -> np.ndarray:
    """Indices of the n tokens in no segment, ascending."""
    inside = np.zeros(n, bool)
    for s in segments:
        inside[s.start : s.end] = True
    return np.flatnonzero(~inside)


def segment_scores(segments: Sequence[Segment], token_scores: np.ndarray) -> np.ndarray:
    """Token scores [..., source] → [..., segment + 1]: each segment's summed token scores (float64), then the
    tokens in no segment ('outside', last)."""
    x = np.asarray(token_scores, dtype=np.float64)
    n = x.shape[-1]
    cols = [x[..., s.start : s.end].sum(-1) for s in segments] + [x[..., outside(segments, n)].sum(-1)]
    return np.stack(cols, axis=-1)


def answer_segment_matrix(
    scores: np.ndarray, segments: Sequence[Segment], answer_start: int | None = None
) -> np.ndarray:
    """The answer tokens × segments matrix: scores [answer, source] @ membership [source, segment], then — where the
    sources run on into the answer itself (`answer_start`: the position of its first token) — the answer's own
    tokens ('(answer)'), then the other tokens in no segment ('outside', last) → [answer, segment + 1 (+ 1)]
    (float64; each row sums to the row of token scores). A single target is the case answer = 1 ([source] is taken
    as [1, source])."""
    x = np.asarray(scores, dtype=np.float64)
    if x.ndim == 1:
        x = x[None]
    if x.ndim != 2:
        raise MixlensError(f"an answer matrix is [answer, source]; got {x.ndim} axes")
    n = x.shape[1]
    cut = n if answer_start is None else answer_start
    if any(s.end > cut for s in segments) or not 0 <= cut <= n:
        raise MixlensError(f"the segments reach past the {cut} context tokens of the answer matrix")
    rest = outside(segments, cut)
    cols = [x @ membership(segments, n)]
    if answer_start is not None:
        cols.append(x[:, cut:].sum(-1, keepdims=True))
    cols.append(x[:, rest].sum(-1, keepdims=True))
    return np.concatenate(cols, axis=1)


def ranked(labels: Sequence[str], values: np.ndarray) -> list[tuple[str, float]]:
    """(label, value) of each segment (values [segment]), highest first (stable)."""
    v = np.asarray(values, dtype=np.float64)
    return [(labels[j], float(v[j])) for j in np.argsort(-v, kind="stable")]


def is_signed(*arrays: np.ndarray) -> bool:
    """Whether scores are signed (a finite negative value; NaN and ±inf do not count) — the same rule as the
    report's and explain's highlighted views (`mixlens.viz.html`): diverging colours centred at 0, else sequential."""
    return any(bool((np.asarray(a)[np.isfinite(a)] < 0).any()) for a in arrays)


def to_json(segments: Sequence[Segment], n: int) -> dict[str, Any]:
    """One input's segmentation: labels, character ranges [start, end), token ranges [start, end) and the tokens in
    no segment (of its n tokens)."""
    return {
        "labels": [s.label for s in segments],
        "char_ranges": [[s.char_start, s.char_end] for s in segments],
        "token_ranges": [[s.start, s.end] for s in segments],
        "outside": [int(i) for i in outside(segments, n)],
    }


def scores_json(segments: Sequence[Segment], token_scores: dict[str, np.ndarray]) -> dict[str, Any]:
    """Each method's segment scores (`scores`: [..., segment]) and outside score, as JSON numbers."""
    both = {m: segment_scores(segments, s) for m, s in token_scores.items()}
    return {
        "scores": {m: v[..., :-1].tolist() for m, v in both.items()},
        "outside_scores": {m: v[..., -1].tolist() for m, v in both.items()},
    }


def _pairs(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
        for p in value
    )


def checked(value: object, text: str, n: int, where: str) -> list[Segment]:
    """One input's segmentation read from a file (`to_json`'s form), checked: labels, character ranges inside the
    text, token ranges inside its n tokens, both disjoint and in order; `outside`, where given, the tokens in no
    segment."""
    if not isinstance(value, dict):
        raise MixlensError(f"{where}: 'segments' must be an object with labels, char_ranges and token_ranges")
    labels, chars, toks = value.get("labels"), value.get("char_ranges"), value.get("token_ranges")
    if not (isinstance(labels, list) and labels and all(isinstance(x, str) for x in labels)):
        raise MixlensError(f"{where}: the segments' 'labels' must be a non-empty list of strings")
    if not (_pairs(chars) and _pairs(toks) and len(chars) == len(toks) == len(labels)):  # type: ignore[arg-type]
        raise MixlensError(f"{where}: the segments need one [start, end] character and token range per label")
    segs = [Segment(lab, c[0], c[1], t[0], t[1]) for lab, c, t in zip(labels, chars, toks, strict=True)]  # type: ignore[arg-type]
    for s in segs:
        if not 0 <= s.char_start < s.char_end <= len(text):
            raise MixlensError(
                f"{where}: segment '{s.label}' has characters [{s.char_start}, {s.char_end}), not inside the "
                f"text of {len(text)} characters"
            )
        if not 0 <= s.start <= s.end <= n:
            raise MixlensError(
                f"{where}: segment '{s.label}' has tokens [{s.start}, {s.end}), not inside the input's {n} tokens"
            )
    filled = [s for s in segs if s.end > s.start]  # an empty token range (no token is mostly its own) has no place
    for a, b in [*zip(segs, segs[1:], strict=False), *zip(filled, filled[1:], strict=False)]:
        if b.char_start < a.char_end or (a.end > a.start and b.start < a.end and b.end > b.start):
            raise MixlensError(f"{where}: segments '{a.label}' and '{b.label}' overlap or are out of order")
    given = value.get("outside")
    if given is not None and given != [int(i) for i in outside(segs, n)]:
        raise MixlensError(f"{where}: the segments' 'outside' tokens are not the tokens in no segment")
    return segs


def check_scores(value: Any, segments: Sequence[Segment], token_scores: dict[str, np.ndarray], where: str) -> None:
    """A loaded file's segment scores (where given) against the sums of its token scores: a file whose numbers
    disagree is refused rather than shown."""
    for key, col in (("scores", slice(None, -1)), ("outside_scores", -1)):
        given = value.get(key)
        if given is None:
            continue
        if not isinstance(given, dict) or set(given) - set(token_scores):
            raise MixlensError(f"{where}: the segments' '{key}' must map the explanation's methods to numbers")
        for m, v in given.items():
            want = segment_scores(segments, token_scores[m])[..., col]
            try:
                got = np.asarray(v, dtype=np.float64)
            except (TypeError, ValueError):
                raise MixlensError(f"{where}: the segments' '{key}' of '{m}' are not numbers") from None
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True):
                raise MixlensError(f"{where}: the segments' '{key}' of '{m}' are not the sums of its token scores")


def checked_all(
    values: Sequence[object], texts: Sequence[str], tokens: Sequence[Sequence[str]], where: str
) -> list[list[Segment]] | None:
    """Every input's segments (`checked`), or None where no input has any; some inputs only → refused."""
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise MixlensError(f"{where}: segments are given for some inputs only")
    return [
        checked(v, t, len(k), f"{where}: input {b + 1}")
        for b, (v, t, k) in enumerate(zip(values, texts, tokens, strict=True))
    ]


def token_scores(attribution: Any, b: int) -> np.ndarray:
    """Input b's token scores [source] of an explanation's method: an explained answer's matrix [answer, source]
    (axes target × source) summed over the answer, as `Explanation.inputs` reads them."""
    x = attribution.input(b)
    return x.sum(0) if tuple(attribution.dims) == ("target", "source") else x


def saved(res: Any) -> list[dict[str, Any]] | None:
    """An analysis's segments for its manifest (`Analysis.save`): each input's `to_json`, or None."""
    segs = getattr(res, "segments", None)
    return None if segs is None else [to_json(s, len(t)) for s, t in zip(segs, res.tokens, strict=True)]


def attach(res: Any, values: Sequence[object] | None, where: str, scores: bool = False) -> Any:
    """`res` (a loaded analysis) with each input's segments read from `values` (`checked_all`; with `scores`, their
    scores checked against the token scores too); segments without explained targets are refused."""
    segs = None if values is None else checked_all(values, res.texts, res.tokens, where)
    if segs is None:
        return res
    if res.explained is None:
        raise MixlensError(f"{where}: segments belong to an explanation; this file explains no target")
    if scores:
        for b, (v, s) in enumerate(zip(values or [], segs, strict=True)):
            tokens = {m: token_scores(a, b) for m, a in res.attributions.items()}
            check_scores(v, s, tokens, f"{where}: input {b + 1}")
    res.segments = segs
    return res
