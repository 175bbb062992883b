"""The data model and metrics of `evaluate` (docs/guides/explain-and-evaluate.md): an `Evaluation` holds the scored
`Example`s and computes every metric from them; it is what evaluation.json saves and loads.

f(x) is the target's probability (classifiers, causal LMs) or the cosine of the pooled embedding to the
unperturbed one (encoders); the target is the model's prediction on the unperturbed input. Special tokens are
never removed; top-k % = the ⌈k/100 · m⌉ highest-scoring of the m non-special tokens (ties: earlier first).

- comprehensiveness = mean_{k ∈ KS} f(x) − f(x without top-k); sufficiency = mean_{k ∈ KS} f(x) − f(only top-k
  and the special tokens); AOPC = mean_{K ∈ AOPC_KS} f(x) − f(x without top-K) (ERASER; DecompX paper);
- removal 'none' runs no perturbed forward pass at all (comprehensiveness, sufficiency and AOPC are then not
  computed: null in the JSON);
- agreement: per-example Spearman ρ with ‖∂g/∂e_j ⊙ e_j‖₂ over the non-special tokens (GlobEnc paper), averaged;
- 95 % bootstrap intervals of every mean over examples (`RESAMPLES` resamples, seeded).

Contrastive tasks with evidence (`mixlens.explain.evidence`): each example keeps its `Contrast` (target, foil and
evidence positions); f is then the logit difference logit(target) − logit(foil) at the last token.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import cast

import numpy as np

KS = (1, 5, 10, 20, 50)
AOPC_KS = (10, 20, 30, 40, 50, 60, 70, 80, 90)
LEVELS = tuple(sorted(set(KS) | set(AOPC_KS)))
REMOVALS = ("delete", "mask", "none")
NO_REMOVAL = "none"  # no perturbed forward passes: the removal metrics are not computed
REMOVAL_METRICS = ("comprehensiveness", "sufficiency", "aopc")
METRICS = (*REMOVAL_METRICS, "spearman_gxi")
RESAMPLES = 1000
RANDOM = "random"
NULL_NOTE = "; written as null (JSON has no NaN)"


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


@dataclass(frozen=True)
class Contrast:
    """One prompt of a contrastive task: its group (e.g. the BLiMP paradigm), the target and foil token ids, the
    words they come from and the evidence: the phrase and its token positions in the prompt."""

    group: str
    target: int
    foil: int
    target_word: str
    foil_word: str
    phrase: str
    evidence: tuple[int, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "group": self.group,
            "target_id": self.target,
            "foil_id": self.foil,
            "target_word": self.target_word,
            "foil_word": self.foil_word,
            "evidence_phrase": self.phrase,
            "evidence": list(self.evidence),
        }

    @classmethod
    def from_json(cls, d: dict) -> Contrast:
        return cls(
            d["group"],
            int(d["target_id"]),
            int(d["foil_id"]),
            d["target_word"],
            d["foil_word"],
            d["evidence_phrase"],
            tuple(int(p) for p in d["evidence"]),
        )


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
    contrast: Contrast | None = None  # contrastive tasks: f is the logit difference target − foil


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
    task: str = "faithfulness"  # or a contrastive task with evidence (`evidence.TASKS`)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)  # contrastive: group → reason → rows skipped
    run: dict[str, object] = field(default_factory=dict)  # the run's identity (`checkpoint.identity`): resume check
    _metrics: tuple[int, dict[str, dict[str, object]]] | None = field(default=None, repr=False)

    def per_example(self, method: str) -> dict[str, np.ndarray]:
        """Each metric per example [E] (removal 'none': the removal metrics are all nan)."""
        ex = self.examples
        agreement = np.array([spearman(e.scores[method][~e.special], e.reference[~e.special]) for e in ex])
        if self.removal == NO_REMOVAL:
            return {**{k: np.full(len(ex), np.nan) for k in REMOVAL_METRICS}, "spearman_gxi": agreement}
        f0 = np.array([e.f for e in ex])
        rem = np.stack([e.removed[method] for e in ex])  # [E, LEVELS]
        kept = np.stack([e.kept[method] for e in ex])  # [E, KS]
        col = {k: i for i, k in enumerate(LEVELS)}
        return {
            "comprehensiveness": (f0[:, None] - rem[:, [col[k] for k in KS]]).mean(1),
            "sufficiency": (f0[:, None] - kept).mean(1),
            "aopc": (f0[:, None] - rem[:, [col[k] for k in AOPC_KS]]).mean(1),
            "spearman_gxi": agreement,
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
        """Deletion curves: mean f(x without top-K) over examples with 95 % intervals, K = 0 and LEVELS (none
        without removal)."""
        if self.removal == NO_REMOVAL:
            return {}
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

    def ranking(self, by: str | None = None) -> list[str]:
        """Methods by a metric, best first (default: AOPC; without removal the agreement)."""
        by = by or ("spearman_gxi" if self.removal == NO_REMOVAL else "aopc")
        met = self.metrics()
        return sorted(self.methods, key=lambda m: -np.nan_to_num(cast(float, met[m][by]), nan=-np.inf))

    def undefined_notes(self) -> list[str]:
        """A note per method and metric whose mean is not a number (e.g. the agreement when every text has fewer
        than two non-special tokens): JSON has no NaN, so they are written as null."""
        out = []
        if self.removal == NO_REMOVAL:
            out.append(
                f"removal none: {', '.join(REMOVAL_METRICS)} not computed (no perturbed forward passes){NULL_NOTE}"
            )
        for m, row in self.metrics().items():
            bad = [
                k
                for k in METRICS
                if not math.isfinite(cast(float, row[k])) and (self.removal != NO_REMOVAL or k not in REMOVAL_METRICS)
            ]
            if bad:
                out.append(
                    f"{m}: {', '.join(bad)} undefined (no example gives a value, e.g. texts of one or only special "
                    f"tokens){NULL_NOTE}"
                )
        return out

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "model": self.model,
            "version": self.version,
            "removal": self.removal,
            "task": self.task,
            "run": self.run,
            "metrics": self.metrics(),
            "deletion_curves": self.curves(),
            "timings": self.timings,
            "notes": [*self.notes, *self.undefined_notes()],
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
                    "ids": e.ids,
                    "special": [bool(v) for v in e.special],
                    "f_removed": {m: [float(v) for v in e.removed[m]] for m in self.methods if m in e.removed},
                    "f_kept": {m: [float(v) for v in e.kept[m]] for m in self.methods if m in e.kept},
                    **({} if e.contrast is None else {"contrast": e.contrast.to_json()}),
                }
                for e in self.examples
            ],
        }
        if self.task != "faithfulness":
            from mixlens.explain.evidence import task_json

            doc.update(task_json(self))
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> Evaluation:
        """The Evaluation saved by `to_json` (metrics and curves are recomputed from the examples)."""
        methods = list(doc["metrics"])
        examples = [
            Example(
                e["text"],
                e["tokens"],
                e["ids"],
                np.array(e["special"], dtype=bool),
                e["target"],
                float("nan") if e["f"] is None else e["f"],
                {m: np.array(e["scores"][m], dtype=float) for m in methods},  # null (NaN in the run) → nan
                np.array(e["grad_x_input_l2"], dtype=float),
                {m: np.array(v, dtype=float) for m, v in e["f_removed"].items()},  # {} without removal
                {m: np.array(v, dtype=float) for m, v in e["f_kept"].items()},
                Contrast.from_json(e["contrast"]) if "contrast" in e else None,
            )
            for e in doc["examples"]
        ]
        return cls(
            doc["model"],
            doc["version"],
            doc["removal"],
            methods,
            examples,
            doc["definitions"]["seed"],
            doc["timings"],
            [n for n in doc["notes"] if not n.endswith(NULL_NOTE)],
            doc.get("task", "faithfulness"),
            {g: dict(r) for g, r in doc.get("skipped", {}).items()},
            dict(doc.get("run", {})),
        )

    def dumps(self) -> str:
        """The JSON of `to_json`, strict: a NaN or ±inf number (an undefined metric, an overflowing score) is
        written as null and named in a note."""
        from mixlens.jsonio import finite, summarize_paths

        doc, where = finite(self.to_json())
        if self.removal == NO_REMOVAL:  # the removal metrics' nulls are named once (undefined_notes)
            where = [w for w in where if not re.search(rf"\.({'|'.join(REMOVAL_METRICS)})(\[\d+\])?$", w)]
        if where:
            doc["notes"].append(f"{len(where)} numbers are not finite ({summarize_paths(where)}){NULL_NOTE}")
        return json.dumps(doc, allow_nan=False)
