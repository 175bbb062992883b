"""Contrastive tasks with evidence for `mixlens evaluate --task blimp` (docs/guides/explain-and-evaluate.md): does an
explanation of a causal LM's next-token choice point at the words that decide it?

Data: the BLiMP / IOI prompts of Ferrando et al. (ACL 2023, "Explaining How Transformers Use Context to Build
Predictions"; their repository mt-upc/logit-explanations, folders data/blimp_with_targets and data/ioi_with_targets):
per row a prompt (`one_prefix_prefix`), the acceptable next word (`one_prefix_word_good`: the target), the
unacceptable one (`one_prefix_word_bad`: the foil), and the evidence (`target_phrase`, else `target`).

- target and foil tokens: the FIRST token of " " + word (a leading space, as the prompt's next word); a row whose
  target and foil share that first token is skipped (the contrast is 0 by construction);
- the evidence: the `target_phrase` where the file has that column, else `target` — but the subject–verb agreement
  paradigms (`*subject_verb_agreement*`, `distractor_agreement*`) use `target`, the subject noun, as the authors'
  code intends (their `target_phrase` there is the whole subject phrase, often the whole prompt); its first
  word-boundary match in the prompt (case-sensitive), and its positions = every token whose characters overlap it;
- rows with `NA` / empty evidence, evidence not found in the prompt, a prompt over the model's position limit
  (never cut), or target = foil are skipped and counted; an empty target or foil word is a broken row, refused in
  one line naming its file and line (it would become the lone-space token);
- the rows stream: `iter_rows` reads the file row by row and `stream` tokenises them in chunks as they are asked
  for (at most `CHUNK` rows or `CHUNK_CHARS` characters at a time), so a run's first example starts after one
  chunk, whatever the file's length, and memory stays flat in it;
- alignment = reciprocal rank of the best-ranked evidence token among the prompt's non-special tokens (scores
  descending, ties: earlier position first); MRR = its mean per paradigm, with the 95 % bootstrap interval;
- accuracy = share of prompts whose logit difference target − foil is > 0; every result is also given for the
  correct and the wrong predictions separately.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mixlens.errors import MixlensError
from mixlens.explain.evaluation import Contrast, Evaluation, bootstrap

TASKS = ("faithfulness", "blimp")  # `mixlens evaluate --task`
NA = {"", "NA", "NaN", "nan", "None"}
PROMPT, GOOD, BAD = "one_prefix_prefix", "one_prefix_word_good", "one_prefix_word_bad"
SPLITS = ("all", "correct", "wrong")
ALL = "all paradigms"
SKIP_NA, SKIP_NOT_FOUND, SKIP_SAME = "evidence NA", "evidence not in the prompt", "target and foil share 1st token"
SKIP_EMPTY, SKIP_LONG = "empty target or foil word", "prompt over the model's position limit"
SKIPS = (SKIP_NA, SKIP_NOT_FOUND, SKIP_SAME, SKIP_EMPTY, SKIP_LONG)


@dataclass(frozen=True)
class Row:
    """One prompt of a task file: its group (the file's stem: the paradigm), prompt, target and foil words and the
    evidence phrase (None: NA)."""

    group: str
    prompt: str
    target: str
    foil: str
    phrase: str | None


def _evidence_column(group: str, header: Sequence[str]) -> str:
    if "subject_verb_agreement" in group or group.startswith("distractor_agreement"):
        return "target"
    return "target_phrase" if "target_phrase" in header else "target"


MAX_FIELD = 1 << 17  # characters of one CSV field (the csv module's limit, 131,072): a longer one is refused
CHUNK = 1024  # prompts tokenised together (`stream` reads the rows in chunks of at most this many)
CHUNK_CHARS = 1 << 20  # and of at most about this many characters (long prompts: fewer rows per chunk)


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.csv"))
        if not files:
            raise MixlensError(f"'{path}' holds no .csv files of the task")
        return files
    if path.is_file():
        return [path]
    raise MixlensError(f"data '{path}' does not exist")


def _lines(f: Path, fh: Iterable[bytes]) -> Iterator[str]:
    """The lines of a task file opened in binary, decoded one by one (so an error names its line): UTF-8, a
    leading byte-order mark dropped; a line that is not UTF-8 or holds a NUL byte (a binary file) is a
    `MixlensError`."""
    for k, raw in enumerate(fh, 1):
        if b"\0" in raw:
            raise MixlensError(f"{f}: line {k} holds a NUL byte: not a text file (a CSV of the task is wanted)")
        try:
            line = raw.decode("utf-8-sig" if k == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise MixlensError(f"{f}: line {k} is not valid UTF-8 (byte {raw[e.start]:#04x})") from None
        yield line


def iter_rows(path: Path, skip: int = 0, limit: int = 0) -> Iterator[Row]:
    """The rows of one task CSV, or of every `*.csv` of a folder (sorted by name; one group per file), streamed;
    `skip` / `limit` apply per file (the first `limit` rows after `skip`). UTF-8, with or without a byte-order
    mark; a file that is not UTF-8 text, a field over `MAX_FIELD` characters or a row with another number of fields
    than the header is a `MixlensError` naming the file and line."""
    for f in _files(path):
        try:
            fh = f.open("rb")
        except OSError as e:
            raise MixlensError(f"cannot read '{f}': {e.strerror or e}") from None
        reader = csv.reader(_lines(f, fh))
        try:
            with fh:
                header = next(reader, None) or []
                need = [c for c in (PROMPT, GOOD, BAD, "target") if c not in header]
                if need:
                    raise MixlensError(
                        f"{f}: not a contrastive task file with evidence: no column {', '.join(need)} "
                        f"(needs {PROMPT}, {GOOD}, {BAD}, target and optionally target_phrase)"
                    )
                col = {name: header.index(name) for name in (PROMPT, GOOD, BAD, _evidence_column(f.stem, header))}
                group, width = f.stem, len(header)
                ev_col, p_col, g_col, b_col = col[_evidence_column(group, header)], col[PROMPT], col[GOOD], col[BAD]
                for k, fields in enumerate(reader):
                    if limit and k >= skip + limit:
                        break
                    if len(fields) != width:
                        raise MixlensError(f"{f}: line {reader.line_num} has {len(fields)} fields, the header {width}")
                    if k < skip:
                        continue
                    ev, good, bad = fields[ev_col].strip(), fields[g_col].strip(), fields[b_col].strip()
                    if not good or not bad:
                        name, role = (GOOD, "target") if not good else (BAD, "foil")
                        raise MixlensError(
                            f"{f}: line {reader.line_num}: {name} (the {role} word) is empty; a row needs both words"
                        )
                    yield Row(group, fields[p_col], good, bad, None if ev in NA else ev)
        except csv.Error as e:
            if "field larger than field limit" in str(e):
                raise MixlensError(
                    f"{f}: line {reader.line_num} has a field longer than {MAX_FIELD:,} characters"
                ) from None
            raise MixlensError(f"{f}: line {reader.line_num}: not a readable CSV row ({e})") from None


def read_rows(path: Path, skip: int = 0, limit: int = 0) -> list[Row]:
    """`iter_rows` as a list; no row at all is a `MixlensError`."""
    rows = list(iter_rows(path, skip, limit))
    if not rows:
        raise MixlensError(f"no prompts in '{path}'" + (f" after skipping {skip}" if skip else ""))
    return rows


def check_rows(path: Path, skip: int = 0, limit: int = 0) -> int:
    """The number of rows `iter_rows` gives, read once without keeping them (a bad file fails here, before the
    model loads); none is a `MixlensError`."""
    n = sum(1 for _ in iter_rows(path, skip, limit))
    if not n:
        raise MixlensError(f"no prompts in '{path}'" + (f" after skipping {skip}" if skip else ""))
    return n


def first_piece(tokenizer, word: str) -> int:
    """The first token of " " + word (the prompt's next word, with its leading space)."""
    ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
    if not ids:
        raise MixlensError(f"the word '{word}' is no token for this tokenizer")
    return int(ids[0])


def evidence_span(prompt: str, phrase: str) -> tuple[int, int] | None:
    """Characters [start, end) of the first word-boundary match of `phrase` in `prompt`, or None."""
    m = re.search(r"(?<!\w)" + re.escape(phrase) + r"(?!\w)", prompt)
    return None if m is None else m.span()


def _chunks(rows: Iterable[Row]) -> Iterator[list[Row]]:
    """`rows` in lists of at most `CHUNK` rows and about `CHUNK_CHARS` prompt characters, read as they are asked for."""
    chunk: list[Row] = []
    chars = 0
    for r in rows:
        chunk.append(r)
        chars += len(r.prompt)
        if len(chunk) >= CHUNK or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def stream(
    tokenizer, rows: Iterable[Row], max_tokens: int | None = None, skipped: dict[str, dict[str, int]] | None = None
) -> Iterator[tuple[str, Contrast]]:
    """(prompt, its `Contrast`) for each usable row, lazily: the rows are read and tokenised in chunks (`_chunks`)
    only as the pairs are asked for. The evidence positions are those of the tokenizer's encoding of each prompt
    (the one `Lens.encode` makes); a prompt of more than `max_tokens` tokens (the model's position limit) is skipped,
    never cut. Rows left out are counted in `skipped` (group → reason → rows) as they are met."""
    if not getattr(tokenizer, "is_fast", False):
        raise MixlensError("the evidence positions need a fast tokenizer (character offsets); this one is slow")
    counts = skipped if skipped is not None else {}

    def skip(group: str, why: str) -> None:
        counts.setdefault(group, {}).setdefault(why, 0)
        counts[group][why] += 1

    for chunk in _chunks(rows):
        enc = tokenizer([r.prompt for r in chunk], return_offsets_mapping=True)
        for r, ids, offsets in zip(chunk, enc["input_ids"], enc["offset_mapping"], strict=True):
            if r.phrase is None:
                skip(r.group, SKIP_NA)
                continue
            if not r.target or not r.foil:  # `iter_rows` refuses such a row; rows built in Python may hold one
                skip(r.group, SKIP_EMPTY)
                continue
            if max_tokens is not None and len(ids) > max_tokens:
                skip(r.group, SKIP_LONG)
                continue
            span = evidence_span(r.prompt, r.phrase)
            pos = (
                ()
                if span is None
                else tuple(k for k, (a, b) in enumerate(offsets) if b > a and a < span[1] and b > span[0])
            )
            if not pos:
                skip(r.group, SKIP_NOT_FOUND)
                continue
            t, f = first_piece(tokenizer, r.target), first_piece(tokenizer, r.foil)
            if t == f:
                skip(r.group, SKIP_SAME)
                continue
            yield r.prompt, Contrast(r.group, t, f, r.target, r.foil, r.phrase, pos)


def prepare(
    tokenizer, rows: Iterable[Row], max_tokens: int | None = None
) -> tuple[list[str], list[Contrast], dict[str, dict[str, int]]]:
    """`stream` collected: (prompts, their `Contrast`s, rows skipped per group and reason)."""
    skipped: dict[str, dict[str, int]] = {}
    pairs = list(stream(tokenizer, rows, max_tokens, skipped))
    return [t for t, _ in pairs], [c for _, c in pairs], skipped


def skip_line(skipped: dict[str, dict[str, int]]) -> str:
    """The rows left out, in words: "12 rows: evidence NA (10), prompt over the model's position limit (2)"."""
    total: dict[str, int] = {}
    for reasons in skipped.values():
        for why, k in reasons.items():
            total[why] = total.get(why, 0) + k
    return f"{sum(total.values())} rows left out: " + ", ".join(f"{why} ({k})" for why, k in total.items())


def reciprocal_rank(scores: np.ndarray, special: np.ndarray, evidence: Sequence[int]) -> float:
    """1 / rank of the best-ranked evidence position among the non-special positions (scores descending, ties:
    earlier position first); nan when no evidence position is a non-special one."""
    cand = np.flatnonzero(~special)
    order = cand[np.lexsort((cand, -np.nan_to_num(scores[cand], nan=-np.inf)))]
    hit = np.flatnonzero(np.isin(order, np.asarray(evidence, dtype=np.int64)))
    return 1.0 / (int(hit[0]) + 1) if len(hit) else float("nan")


def _mean(v: np.ndarray) -> float:
    v = v[~np.isnan(v)]
    return float(v.mean()) if len(v) else float("nan")


def per_example(ev: Evaluation) -> dict[str, np.ndarray]:
    """Per example: 'rr:<method>' reciprocal ranks, 'comprehensiveness:<method>' etc. (on the logit difference),
    'correct' (bool as float) and 'group' (object)."""
    out: dict[str, np.ndarray] = {}
    ex = ev.examples
    for m in ev.methods:
        out[f"rr:{m}"] = np.array([reciprocal_rank(e.scores[m], e.special, e.contrast.evidence) for e in ex])  # type: ignore[union-attr]
        for k, v in ev.per_example(m).items():
            if k != "spearman_gxi":
                out[f"{k}:{m}"] = v
    out["correct"] = np.array([float(e.f > 0) for e in ex])
    out["group"] = np.array([e.contrast.group for e in ex], dtype=object)  # type: ignore[union-attr]
    return out


def task_metrics(ev: Evaluation) -> dict[str, dict[str, object]]:
    """Per group (paradigm, then every group pooled as `ALL`): n, accuracy [interval], rows skipped, and per split
    (all / correct / wrong predictions) its n and per method MRR, comprehensiveness, sufficiency and AOPC on the
    logit difference, each with its 95 % bootstrap interval."""
    per = per_example(ev)
    groups = list(dict.fromkeys(per["group"].tolist()))
    out: dict[str, dict[str, object]] = {}
    for g in [*groups, ALL]:
        sel = np.ones(len(ev.examples), bool) if g == ALL else per["group"] == g
        correct = per["correct"][sel]
        skipped = (
            {k: sum(s.get(k, 0) for s in ev.skipped.values()) for k in SKIPS} if g == ALL else ev.skipped.get(g, {})
        )
        row: dict[str, object] = {
            "n": int(sel.sum()),
            "accuracy": _mean(correct),
            "accuracy_ci95": bootstrap(correct, ev.seed),
            "skipped": {k: v for k, v in skipped.items() if v},
        }
        for split in SPLITS:
            pick = sel if split == "all" else sel & ((per["correct"] == 1) == (split == "correct"))
            block: dict[str, object] = {"n": int(pick.sum())}
            for m in ev.methods:
                vals = {
                    "mrr": per[f"rr:{m}"][pick],
                    **{k: per[f"{k}:{m}"][pick] for k in ("comprehensiveness", "sufficiency", "aopc")},
                }
                block[m] = {
                    **{k: _mean(v) for k, v in vals.items()},
                    "ci95": {k: bootstrap(v, ev.seed) for k, v in vals.items()},
                }
            row[split] = block
        out[g] = row
    return out


def task_json(ev: Evaluation) -> dict[str, object]:
    """The task's part of evaluation.json: its results per paradigm and the rows skipped."""
    metrics = task_metrics(ev)
    for row in metrics.values():  # a split without prompts: its metrics are null by definition, not non-finite
        for split in SPLITS:
            block: Any = row[split]
            if block["n"] == 0:
                row[split] = {"n": 0, **{m: None for m in ev.methods}}
    return {
        "task_metrics": metrics,
        "skipped": ev.skipped,
        "task_definitions": {
            "f": "logit(target) − logit(foil) at the last token; comprehensiveness / sufficiency / AOPC on it",
            "target_foil": "first token of ' ' + word; rows whose target and foil share it are skipped",
            "alignment": "reciprocal rank of the best-ranked evidence token among the non-special tokens "
            "(scores descending, ties: earlier first); MRR = mean per paradigm",
            "accuracy": "share of prompts with logit difference > 0",
            "splits": "all, correct (logit difference > 0) and wrong predictions; a split without prompts (n = 0, "
            "e.g. a paradigm the model never gets wrong) has null in place of each method's metrics",
        },
    }
