"""Relation heads from annotated word pairs (Clark et al. 2019 style, with a matched positional baseline).

Input: records of pre-split words with labelled word pairs (`RelationRecord`; JSONL format in
docs/guides/bertology.md). For every head, view (`attn` = α^h, `norm` = α^h_ij ‖f^h(x_j)‖ row-normalised, as
`mixlens.stats.heads.view_maps`) and relation, the weight from the `from` word to the `to` word at word
level (to a word = sum over its pieces, from a word = mean, as `Attribution.to_words`).

Baseline and test. Each annotated pair (i → j) has a stratum: all word pairs (a → a + δ) of the same
sentence at the same signed distance δ = j − i (the pair itself included). Under the null hypothesis
"the relation does not matter, only position does", the annotated pair is a uniformly random member of
its stratum. `baseline` = mean over pairs of the stratum mean; `effect` = mean weight − baseline; the
permutation test draws one random stratum member per pair (seeded), `n_permutations` times, and reports the
two-sided p = (1 + #{|perm − baseline| ≥ |effect|}) / (1 + n_permutations). Strata of one pair carry no
information and are left out.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from mixlens import jsonio
from mixlens.errors import MixlensError

UD_RELATIONS = ("nsubj", "obj", "amod", "advmod")
VIEWS = ("attn", "norm")


@dataclass
class RelationPair:
    source: int  # 0-based word index of the `from` word
    target: int  # 0-based word index of the `to` word
    relation: str


@dataclass
class RelationRecord:
    words: list[str]
    pairs: list[RelationPair]


def _record(obj: object, where: str) -> RelationRecord:
    """One JSON object → record, checking every index against the words (one-line errors)."""
    if not isinstance(obj, dict):
        raise MixlensError(f"{where}: expected a JSON object with 'words' (or 'text') and 'pairs'")
    words = obj.get("words")
    if words is None and isinstance(obj.get("text"), str):
        words = obj["text"].split()
    if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() for w in words):
        raise MixlensError(f"{where}: 'words' must be a non-empty list of non-empty strings (or give 'text')")
    pairs = obj.get("pairs")
    if not isinstance(pairs, list):
        raise MixlensError(f'{where}: \'pairs\' must be a list of {{"from": i, "to": j, "relation": ...}}')
    out = []
    for k, p in enumerate(pairs):
        if not isinstance(p, dict) or not isinstance(p.get("relation"), str) or not p["relation"]:
            raise MixlensError(f"{where}: pair {k + 1} needs 'from', 'to' and a 'relation' label")
        ends = []
        for key in ("from", "to"):
            v = p.get(key)
            if isinstance(v, str):  # a word instead of an index: must occur exactly once
                hits = [i for i, w in enumerate(words) if w == v]
                if len(hits) != 1:
                    raise MixlensError(
                        f"{where}: pair {k + 1}: word '{v}' occurs {len(hits)} times in the "
                        "text (give its 0-based index instead)"
                    )
                v = hits[0]
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < len(words):
                raise MixlensError(
                    f"{where}: pair {k + 1}: '{key}' = {v!r} is not a word index of the text (0..{len(words) - 1})"
                )
            ends.append(v)
        if ends[0] == ends[1]:
            raise MixlensError(f"{where}: pair {k + 1} relates word {ends[0]} to itself")
        out.append(RelationPair(ends[0], ends[1], p["relation"]))
    return RelationRecord(list(words), out)


def read_relations(path: str | Path, limit: int | None = None) -> list[RelationRecord]:
    """Records of a relation JSONL file (one object per line)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise MixlensError(f"relation file '{path}' does not exist")
    records = []
    with p.open("rb") as fh:
        for no, raw in enumerate(fh, start=1):
            if no == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
            if not raw.strip():
                continue
            # not UTF-8, not JSON, nested too deeply, an integer past Python's digit limit: one line
            obj = jsonio.loads(raw, f"{path}: line {no}", kind=None)
            records.append(_record(obj, f"{path}: line {no}"))
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise MixlensError(f"{path} holds no records")
    return records


def conllu_records(
    path: str | Path, relations: Sequence[str] = UD_RELATIONS, limit: int | None = None
) -> list[RelationRecord]:
    """Records from a CoNLL-U file: pairs dependent → head for the given relations (subtypes folded)."""
    from mixlens.stats.syntax import read_conllu

    wanted = set(relations)
    return [
        RelationRecord(
            s.words,
            [
                RelationPair(d, h, r)
                for d, (h, r) in enumerate(zip(s.heads, s.relations, strict=True))
                if r in wanted and h >= 0
            ],
        )
        for s in read_conllu(path, limit)
    ]


def write_relations(records: Sequence[RelationRecord], path: str | Path) -> None:
    """The JSONL format `read_relations` reads."""
    from mixlens.result import atomic_write

    lines = [
        json.dumps(
            {"words": r.words, "pairs": [{"from": p.source, "to": p.target, "relation": p.relation} for p in r.pairs]},
            ensure_ascii=False,
        )
        for r in records
    ]
    atomic_write(Path(path), ("\n".join(lines) + "\n").encode())


@dataclass
class RelationReport:
    """`table`: one row per (relation, view, layer, head): count (pairs with an informative stratum),
    mean, baseline, effect, p. `n_records`: records read; `skipped`: pairs left out (a word cut off by
    truncation or without pieces, or a stratum of one pair)."""

    table: pd.DataFrame
    n_records: int
    skipped: int

    def best(self) -> pd.DataFrame:
        """Per relation and view the head with the largest effect."""
        t = self.table
        return t.loc[t.groupby(["relation", "view"], sort=True)["effect"].idxmax()].reset_index(drop=True)


def permutation_test(
    strata: list[np.ndarray], observed: np.ndarray, n_permutations: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stratified permutation test. strata[k] [m_k, ...]: all values of pair k's stratum; observed [K, ...]:
    the annotated pairs' values → (mean, baseline, p), each [...]."""
    sizes = np.array([len(s) for s in strata])
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    flat = np.concatenate(strata)  # [Σ m_k, ...]
    mean = observed.mean(0)
    baseline = np.stack([s.mean(0) for s in strata]).mean(0)
    effect = np.abs(mean - baseline)
    rng = np.random.default_rng(seed)
    extreme = np.zeros_like(mean)
    chunk = max(1, int(2e7 // max(1, flat[0].size * len(strata))))
    for start in range(0, n_permutations, chunk):
        p = min(chunk, n_permutations - start)
        idx = offsets + np.floor(rng.random((p, len(strata))) * sizes).astype(np.int64)  # [p, K]
        draws = flat[idx].mean(1)  # [p, ...]
        extreme += (np.abs(draws - baseline) >= effect - 1e-12).sum(0)
    return mean, baseline, (1 + extreme) / (1 + n_permutations)


def relation_heads(
    lens,
    records: Sequence[RelationRecord],
    *,
    n_permutations: int = 1000,
    seed: int = 0,
    batch_size: int = 32,
    max_length: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> RelationReport:
    """Mean attention and norm-based weight per head and relation against the same-distance baseline."""
    from mixlens.stats.heads import view_maps
    from mixlens.stats.syntax import seen_words, word_maps

    if not records:
        raise MixlensError("no relation records given")
    if n_permutations < 1:
        raise MixlensError("the permutation test needs at least one permutation")
    observed: dict[str, list[np.ndarray]] = {}  # relation → K × [V, L, H]
    strata: dict[str, list[np.ndarray]] = {}  # relation → K × [m, V, L, H]
    skipped = 0
    words = [r.words for r in records]
    for batch in lens.batches(words, batch_size, max_length, trace=["attention"]):  # attention maps: no FFN
        tr, word_ids = batch.trace, batch.enc.words
        assert tr is not None  # trace=[...]
        with torch.no_grad():
            maps = torch.stack([view_maps(tr, v) for v in VIEWS], 2).cpu()  # [B, L, V, H, n, n]
        for b, rec in enumerate(records[k] for k in batch.index):
            n = int(tr.mask[b].sum())
            seen = seen_words(word_ids[b], n, len(rec.words))  # maps sized by the words the model sees
            wmap_t, has_t = word_maps(maps[b, ..., :n, :n], word_ids[b], seen)  # [L, V, H, W, W]
            wmap = wmap_t.permute(3, 4, 1, 0, 2).numpy()  # [W, W, V, L, H]
            has = has_t.numpy()
            for pair in rec.pairs:
                i, j = pair.source, pair.target
                delta = j - i
                a = np.arange(max(0, -delta), min(seen, seen - delta))
                a = a[has[a] & has[a + delta]]
                if i >= seen or j >= seen or not (has[i] and has[j]) or len(a) < 2:
                    skipped += 1
                    continue
                observed.setdefault(pair.relation, []).append(wmap[i, j])
                strata.setdefault(pair.relation, []).append(wmap[a, a + delta])
        if on_batch:
            on_batch(len(word_ids))
    if not observed:
        raise MixlensError("no relation pair could be scored (words cut off, or every stratum has one pair)")
    rows = []
    for k, rel in enumerate(sorted(observed)):
        mean, base, p = permutation_test(strata[rel], np.stack(observed[rel]), n_permutations, seed + k)
        for v, view in enumerate(VIEWS):
            for layer in range(mean.shape[1]):
                for head in range(mean.shape[2]):
                    rows.append(
                        (
                            rel,
                            view,
                            layer,
                            head,
                            len(observed[rel]),
                            mean[v, layer, head],
                            base[v, layer, head],
                            mean[v, layer, head] - base[v, layer, head],
                            p[v, layer, head],
                        )
                    )
    table = pd.DataFrame(
        rows, columns=["relation", "view", "layer", "head", "count", "mean", "baseline", "effect", "p"]
    )
    return RelationReport(table, len(records), skipped)


def relation_figure(report: RelationReport, path: Path, alpha: float = 0.01) -> None:
    """One layer × head heatmap of the effect per relation (rows) and view (columns); dots mark p < alpha."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = report.table
    rels = sorted(t["relation"].unique())
    n_layers, n_heads = int(t["layer"].max()) + 1, int(t["head"].max()) + 1
    fig, axes = plt.subplots(
        len(rels),
        len(VIEWS),
        figsize=(0.42 * n_heads * len(VIEWS) + 2.5, 0.42 * n_layers * len(rels) + 1.2),
        squeeze=False,
    )
    titles = {"attn": "attention weight", "norm": "norm-based weight ‖αf(x)‖"}
    for r, rel in enumerate(rels):
        for v, view in enumerate(VIEWS):
            s = t[(t["relation"] == rel) & (t["view"] == view)].sort_values(["layer", "head"])
            grid = s["effect"].to_numpy().reshape(n_layers, n_heads)
            sig = s["p"].to_numpy().reshape(n_layers, n_heads) < alpha
            lim = max(float(np.abs(grid).max()), 1e-6)
            ax = axes[r, v]
            im = ax.imshow(grid, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
            ys, xs = np.nonzero(sig)
            ax.scatter(xs, ys, s=7, c="k", marker="o", edgecolors="w", linewidths=0.4)
            ax.set_title(f"{rel} ({int(s['count'].iloc[0])} pairs): {titles[view]}", fontsize=8)
            ax.set_xlabel("head", fontsize=7)
            ax.set_ylabel("layer", fontsize=7)
            ax.set_xticks(range(n_heads))
            ax.set_yticks(range(n_layers))
            ax.tick_params(labelsize=6)
            cb = fig.colorbar(im, ax=ax, fraction=0.04)
            cb.set_label("mean weight minus\nsame-distance baseline", fontsize=6)
            cb.ax.tick_params(labelsize=6)
    fig.suptitle(f"Relation heads: weight from the first word to the second (dots: p < {alpha})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
