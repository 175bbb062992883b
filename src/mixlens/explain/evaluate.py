"""`evaluate`: which explanation to trust, by removing the tokens it ranks highest (docs/evaluate.md).

f(x) is the target's probability (classifiers, causal LMs) or the cosine of the pooled embedding to the
unperturbed one (encoders); the target is the model's prediction on the unperturbed input. Special tokens are
never removed; top-k % = the ⌈k/100 · m⌉ highest-scoring of the m non-special tokens (ties: earlier first).

- comprehensiveness = mean_{k ∈ KS} f(x) − f(x without top-k); sufficiency = mean_{k ∈ KS} f(x) − f(only top-k
  and the special tokens); AOPC = mean_{K ∈ AOPC_KS} f(x) − f(x without top-K) (ERASER; DecompX paper);
- removal 'delete' drops the tokens from the input ids, 'mask' replaces them with the mask token;
- agreement: per-example Spearman ρ with ‖∂g/∂e_j ⊙ e_j‖₂ over the non-special tokens (GlobEnc paper), averaged;
- 95 % bootstrap intervals of every mean over examples (`RESAMPLES` resamples, seeded).

Perturbed inputs of all methods and examples of a batch are de-duplicated and run together, sorted by length.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from mixlens.errors import MixlensError
from mixlens.explain import attributions as attr
from mixlens.explain.explain import pad_batch
from mixlens.explain.targets import model_kind, resolve, scores

KS = (1, 5, 10, 20, 50)
AOPC_KS = (10, 20, 30, 40, 50, 60, 70, 80, 90)
LEVELS = tuple(sorted(set(KS) | set(AOPC_KS)))
REMOVALS = ("delete", "mask")
METRICS = ("comprehensiveness", "sufficiency", "aopc", "spearman_gxi")
RESAMPLES = 1000
RANDOM = "random"
FORWARD_TOKENS = 8192  # tokens per forward pass of perturbed inputs


def top_k(score: np.ndarray, special: np.ndarray, pct: float) -> np.ndarray:
    """Positions of the top-`pct` % non-special tokens by score (ties: earlier position first), ⌈pct·m/100⌉ of them."""
    cand = np.flatnonzero(~special)
    k = math.ceil(pct * len(cand) / 100 - 1e-9)
    order = np.lexsort((cand, -score[cand]))  # primary key: score descending; then position ascending
    return np.sort(cand[order[:k]])


def perturb(
    ids: list[int], chosen: np.ndarray, special: np.ndarray, keep: bool, removal: str, mask_id: int | None
) -> tuple[int, ...]:
    """Remove the `chosen` positions (keep=False) or every non-special position but them (keep=True)."""
    hit = np.zeros(len(ids), dtype=bool)
    hit[chosen] = True
    drop = (~hit & ~special) if keep else hit
    if removal == "delete":
        return tuple(t for t, d in zip(ids, drop, strict=True) if not d)
    assert mask_id is not None  # removal "mask" needs a mask token (checked by evaluate)
    return tuple(mask_id if d else t for t, d in zip(ids, drop, strict=True))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman ρ (average ranks for ties); nan when either side is constant or shorter than 2."""
    from scipy.stats import rankdata

    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(np.corrcoef(rankdata(a), rankdata(b))[0, 1])


def bootstrap(values: np.ndarray, seed: int, resamples: int = RESAMPLES) -> list[float]:
    """95 % percentile interval of the mean of `values` (nan entries dropped)."""
    v = values[~np.isnan(values)]
    if not len(v):
        return [float("nan"), float("nan")]
    idx = np.random.default_rng(seed).integers(0, len(v), size=(resamples, len(v)))
    means = v[idx].mean(1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


@dataclass
class Example:
    text: str
    tokens: list[str]
    ids: list[int]
    special: np.ndarray  # [n] bool
    target: dict[str, object]
    f: float
    scores: dict[str, np.ndarray]  # method → [n]
    reference: np.ndarray  # [n] ‖∂g/∂e ⊙ e‖₂
    removed: dict[str, np.ndarray] = field(default_factory=dict)  # method → f(x without top-K) per LEVELS
    kept: dict[str, np.ndarray] = field(default_factory=dict)  # method → f(only top-k) per KS


@dataclass
class Evaluation:
    model: str
    version: str
    removal: str
    methods: list[str]
    examples: list[Example]
    seed: int
    timings: dict[str, float]  # seconds: per method, and 'forward', 'total', 'own'
    notes: list[str]
    _metrics: tuple[int, dict[str, dict[str, object]]] | None = field(default=None, repr=False)

    def per_example(self, method: str) -> dict[str, np.ndarray]:
        """Each metric per example [E]."""
        ex = self.examples
        f0 = np.array([e.f for e in ex])
        rem = np.stack([e.removed[method] for e in ex])  # [E, LEVELS]
        kept = np.stack([e.kept[method] for e in ex])  # [E, KS]
        col = {k: i for i, k in enumerate(LEVELS)}
        return {
            "comprehensiveness": (f0[:, None] - rem[:, [col[k] for k in KS]]).mean(1),
            "sufficiency": (f0[:, None] - kept).mean(1),
            "aopc": (f0[:, None] - rem[:, [col[k] for k in AOPC_KS]]).mean(1),
            "spearman_gxi": np.array([spearman(e.scores[method][~e.special], e.reference[~e.special]) for e in ex]),
        }

    def metrics(self) -> dict[str, dict[str, object]]:
        """Each metric's mean over examples and its 95 % bootstrap interval, per method (computed once)."""
        if self._metrics is not None and self._metrics[0] == len(self.examples):
            return self._metrics[1]
        out: dict[str, dict[str, object]] = {}
        for m in self.methods:
            per = self.per_example(m)
            row: dict[str, object] = {
                k: float(np.nanmean(v)) if (~np.isnan(v)).any() else float("nan") for k, v in per.items()
            }
            row["ci95"] = {k: bootstrap(v, self.seed) for k, v in per.items()}
            out[m] = row
        self._metrics = (len(self.examples), out)
        return out

    def curves(self) -> dict[str, dict[str, list[float]]]:
        """Deletion curves: mean f(x without top-K) over examples with 95 % intervals, K = 0 and LEVELS."""
        f0 = np.array([e.f for e in self.examples])
        out = {}
        for m in self.methods:
            rem = np.column_stack([f0, np.stack([e.removed[m] for e in self.examples])])
            ci = [bootstrap(rem[:, j], self.seed) for j in range(rem.shape[1])]
            out[m] = {
                "k": [0, *LEVELS],
                "mean": rem.mean(0).tolist(),
                "low": [c[0] for c in ci],
                "high": [c[1] for c in ci],
            }
        return out

    def ranking(self, by: str = "aopc") -> list[str]:
        met = self.metrics()
        return sorted(self.methods, key=lambda m: -np.nan_to_num(cast(float, met[m][by]), nan=-np.inf))

    def to_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "version": self.version,
            "removal": self.removal,
            "metrics": self.metrics(),
            "deletion_curves": self.curves(),
            "timings": self.timings,
            "notes": self.notes,
            "definitions": {
                "k_comprehensiveness_sufficiency": list(KS),
                "k_aopc": list(AOPC_KS),
                "bootstrap_resamples": RESAMPLES,
                "seed": self.seed,
            },
            "examples": [
                {
                    "text": e.text,
                    "tokens": e.tokens,
                    "target": e.target,
                    "f": e.f,
                    "scores": {m: [float(v) for v in e.scores[m]] for m in self.methods},
                    "grad_x_input_l2": [float(v) for v in e.reference],
                }
                for e in self.examples
            ],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json())


def _special_mask(lens, ids: list[int]) -> np.ndarray:
    return np.array([r is not None and r != "unk" for r in lens.special_roles(ids)], dtype=bool)


def _forward_f(
    lens, kind: str, pool: str, seqs: list[tuple[int, ...]], owners: list[int], index: torch.Tensor, e0: torch.Tensor
) -> np.ndarray:
    """f of every perturbed sequence (owner = its example's row in index / e0), batched by length. A sequence
    emptied by removal (models without special tokens) is read as the single BOS (else EOS, else CLS) token."""
    tok = lens.tokenizer
    start_id = next((t for t in (tok.bos_token_id, tok.eos_token_id, tok.cls_token_id) if t is not None), None)
    seqs = [s if s or start_id is None else (start_id,) for s in seqs]
    out = np.zeros(len(seqs))
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and (stop - start + 1) * len(seqs[order[stop]]) <= FORWARD_TOKENS:
            stop += 1
        rows = order[start:stop]
        inputs = pad_batch(lens, [list(seqs[i]) for i in rows])
        own = torch.tensor([owners[i] for i in rows])
        with torch.no_grad():
            res = lens.model(**inputs)
            f = scores(kind, pool, res, inputs["attention_mask"], index[own], torch.full((len(rows),), -1), e0[own])[1]
        out[rows] = f.float().cpu().numpy()
        start = stop
    return out


def evaluate(
    lens,
    texts: Sequence[str],
    methods: Sequence[str] | None = None,
    *,
    removal: str = "delete",
    batch_size: int = 8,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Evaluation:
    """Evaluate `methods` (default: every applicable one but exact HTA) plus a seeded random baseline."""
    from mixlens import __version__

    t_start = time.perf_counter()
    texts = [t for t in texts]
    if not texts:
        raise MixlensError("no examples to evaluate (the data file is empty?)")
    if removal not in REMOVALS:
        raise MixlensError(f"unknown removal '{removal}'; valid: {', '.join(REMOVALS)}")
    mask_id = lens.tokenizer.mask_token_id
    if removal == "mask" and mask_id is None:
        raise MixlensError("--removal mask needs a model with a mask token; this tokenizer has none (use delete)")
    kind = model_kind(lens.model)
    chosen = list(methods) if methods else attr.default_methods(kind)
    notes = [] if methods else [f"left out of the default set (too slow on long runs): {', '.join(attr.SLOW)}"]
    real = attr.check_methods(kind, [m for m in chosen if m != RANDOM])
    all_methods = [*real, RANDOM]
    rng = np.random.default_rng(seed)
    timings: dict[str, float] = {"forward": 0.0}
    examples: list[Example] = []
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        enc = lens.encode(chunk)
        ids = [enc.inputs["input_ids"][b, : len(t)].tolist() for b, t in enumerate(enc.tokens)]
        inputs = pad_batch(lens, ids)
        targets, ro, f0 = resolve(lens, inputs, None, None)
        res = attr.attribute(lens, inputs, ro, real, seed=seed, reference=True, timings=timings)
        batch = []
        for b, x in enumerate(ids):
            sc = {m: res[m][b, : len(x)].numpy() for m in real}
            sc[RANDOM] = rng.random(len(x))
            batch.append(
                Example(
                    chunk[b],
                    enc.tokens[b],
                    x,
                    _special_mask(lens, x),
                    targets[b].to_json(float(f0[b])),
                    float(f0[b]),
                    sc,
                    res[attr.REFERENCE][b, : len(x)].numpy(),
                )
            )
        seqs: dict[tuple[tuple[int, ...], int], int] = {}  # (sequence, example) → row
        plan = []
        for b, e in enumerate(batch):
            for m in all_methods:
                for keep, levels in ((False, LEVELS), (True, KS)):
                    for k in levels:
                        s = perturb(e.ids, top_k(e.scores[m], e.special, k), e.special, keep, removal, mask_id)
                        plan.append((b, m, keep, k, seqs.setdefault((s, b), len(seqs))))
        t0 = time.perf_counter()
        keys = list(seqs)
        e0 = ro.e0 if ro.e0 is not None else torch.zeros(len(batch), 1)
        fs = _forward_f(lens, ro.kind, ro.pool, [s for s, _ in keys], [b for _, b in keys], ro.index, e0)
        timings["forward"] += time.perf_counter() - t0
        for e in batch:
            e.removed = {m: np.zeros(len(LEVELS)) for m in all_methods}
            e.kept = {m: np.zeros(len(KS)) for m in all_methods}
        for b, m, keep, k, row in plan:
            if keep:
                batch[b].kept[m][KS.index(k)] = fs[row]
            else:
                batch[b].removed[m][LEVELS.index(k)] = fs[row]
        examples += batch
        if progress:
            progress(len(examples), len(texts))
    timings["total"] = time.perf_counter() - t_start
    timings["attributions"] = sum(v for k, v in timings.items() if k in real)
    timings["own"] = timings["total"] - timings["attributions"] - timings["forward"]
    return Evaluation(lens.name, __version__, removal, all_methods, examples, seed, timings, notes)


def stderr_progress(done: int, total: int) -> None:
    """Progress on stderr, only on a terminal."""
    if sys.stderr.isatty():
        print(f"\revaluated {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)
