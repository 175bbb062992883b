"""`evaluate`: which explanation to trust, by removing the tokens it ranks highest (docs/evaluate.md).

f(x) is the target's probability (classifiers, causal LMs) or the cosine of the pooled embedding to the
unperturbed one (encoders); the target is the model's prediction on the unperturbed input. Special tokens are
never removed; top-k % = the ⌈k/100 · m⌉ highest-scoring of the m non-special tokens (ties: earlier first).

- comprehensiveness = mean_{k ∈ KS} f(x) − f(x without top-k); sufficiency = mean_{k ∈ KS} f(x) − f(only top-k
  and the special tokens); AOPC = mean_{K ∈ AOPC_KS} f(x) − f(x without top-K) (ERASER; DecompX paper);
- removal 'delete' drops the tokens from the input ids, 'mask' replaces them with the mask token; 'none' runs no
  perturbed forward pass at all (comprehensiveness, sufficiency and AOPC are then not computed: null in the JSON),
  for runs that need only the agreement or a contrastive task's alignment with the evidence;
- agreement: per-example Spearman ρ with ‖∂g/∂e_j ⊙ e_j‖₂ over the non-special tokens (GlobEnc paper), averaged;
- 95 % bootstrap intervals of every mean over examples (`RESAMPLES` resamples, seeded).

Perturbed inputs of all methods and examples of a batch are de-duplicated and run together, sorted by length.

Contrastive tasks with evidence (`mixlens.explain.evidence`, e.g. BLiMP): each input brings its own target and foil
token; f(x) is then the logit difference logit(target) − logit(foil) at the last token, the same definitions apply
to it, and each example also keeps its evidence positions (alignment: reciprocal rank, `evidence.reciprocal_rank`).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import numpy as np
import torch

from mixlens.errors import MixlensError
from mixlens.explain import attributions as attr
from mixlens.explain.explain import explained_kind, read_targets, report_truncated
from mixlens.methods import get as get_method
from mixlens.methods.saliency import keeps_logits
from mixlens.pipeline import plan_batches
from mixlens.targets import KIND_NAMES, score

KS = (1, 5, 10, 20, 50)
AOPC_KS = (10, 20, 30, 40, 50, 60, 70, 80, 90)
LEVELS = tuple(sorted(set(KS) | set(AOPC_KS)))
REMOVALS = ("delete", "mask", "none")
NO_REMOVAL = "none"  # no perturbed forward passes: the removal metrics are not computed
REMOVAL_METRICS = ("comprehensiveness", "sufficiency", "aopc")
METRICS = (*REMOVAL_METRICS, "spearman_gxi")
RESAMPLES = 1000
RANDOM = "random"
FORWARD_TOKENS = 8192  # tokens per forward pass of perturbed inputs
CHECKPOINT_EVERY = 60.0  # seconds between saves of the finished examples (a run killed without warning resumes)
NULL_NOTE = "; written as null (JSON has no NaN)"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `evaluate`: `partial` holds the Evaluations of the examples finished before it (per removal;
    empty when none finished)."""

    def __init__(self, partial: dict[str, Evaluation], total: int) -> None:
        super().__init__()
        self.partial = partial
        self.total = total


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


def _special_mask(lens, ids: list[int]) -> np.ndarray:
    return np.array([r is not None and r != "unk" for r in lens.special_roles(ids)], dtype=bool)


def _last_token_f(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], index: torch.Tensor, foil: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal LMs: the target token's probability (with `foil` [B]: the logit difference target − foil) at each
    row's last real token, unembedding only the distinct last positions of the batch (sorted by length, so few)
    instead of all n: [B]."""
    last = inputs["attention_mask"].sum(-1) - 1  # [B]
    keep, where = torch.unique(last, return_inverse=True)
    logits = model(**inputs, logits_to_keep=keep).logits  # [B, len(keep), V]
    rows = logits[torch.arange(last.shape[0], device=last.device), where].float()  # [B, V]
    if foil is not None:
        idx = torch.stack([index, foil], 1).to(rows.device)
        pair = rows.gather(1, idx)
        return pair[:, 0] - pair[:, 1]
    return rows.softmax(-1).gather(1, index.to(rows.device)[:, None])[:, 0]


def _forward_f(
    lens,
    kind: str,
    pool: str,
    seqs: list[tuple[int, ...]],
    owners: list[int],
    index: torch.Tensor,
    e0: torch.Tensor,
    foil: torch.Tensor | None = None,
) -> np.ndarray:
    """f of every perturbed sequence (owner = its example's row in index / e0 / foil), batched by length; with
    `foil` (a contrastive task) the logit difference target − foil. A sequence emptied by removal (models without
    special tokens) is read as the single BOS (else EOS, else CLS) token."""
    tok = lens.tokenizer
    start_id = next((t for t in (tok.bos_token_id, tok.eos_token_id, tok.cls_token_id) if t is not None), None)
    seqs = [s if s or start_id is None else (start_id,) for s in seqs]
    out = np.zeros(len(seqs))
    for rows in plan_batches([len(x) for x in seqs], len(seqs), max_tokens=FORWARD_TOKENS):  # by length
        inputs = lens.encode_ids([seqs[i] for i in rows]).inputs
        own = torch.tensor([owners[i] for i in rows])
        with torch.no_grad():
            if kind == "causal" and keeps_logits(lens.model):
                f = _last_token_f(lens.model, inputs, index[own], None if foil is None else foil[own])
            else:
                res = lens.model(**inputs)
                mask = inputs["attention_mask"]
                last = mask.sum(-1).cpu() - 1 if kind == "causal" else torch.zeros(len(rows), dtype=torch.long)
                fo = torch.full((len(rows),), -1) if foil is None else foil[own]
                g, f = score(kind, pool, res, mask, index[own], fo, last, e0[own])
                f = f if foil is None else g
        out[rows] = f.float().cpu().numpy()
    return out


def evaluate(
    lens,
    texts: Sequence[str],
    methods: Sequence[str] | None = None,
    *,
    removal: str = "delete",
    batch_size: int = 8,
    seed: int = 0,
    progress: Callable[[float, int], None] | None = None,
    resume: Evaluation | None = None,
    contrasts: Sequence[Contrast] | None = None,
    task: str = "faithfulness",
    skipped: dict[str, dict[str, int]] | None = None,
    checkpoint: Callable[[Evaluation], object] | None = None,
    checkpoint_every: float | None = None,
) -> Evaluation:
    """Evaluate `methods` (default: every applicable one but exact HTA) plus a seeded random baseline.
    `progress(done, total)`: inputs done (fractions as each method and the perturbed passes of a batch finish).
    `resume`: the `Interrupted.partial` Evaluation (or its JSON, `Evaluation.from_json`) of an interrupted run of
    the same texts, methods, removal and seed: its examples are kept and the run continues after them.
    `contrasts` (a contrastive task named `task`, `mixlens.explain.evidence`): each text's own target, foil and
    evidence; f is then the logit difference; `skipped` counts the task's rows left out, per group and reason.
    `checkpoint(partial)`: called with the Evaluation of the examples finished so far at most every
    `checkpoint_every` seconds (default `CHECKPOINT_EVERY`; after a batch), so that a run killed without warning
    (SIGKILL, a lost machine) can resume from the last one; the CLI writes it as an interrupted evaluation.json."""
    return evaluate_removals(
        lens,
        texts,
        methods,
        removals=(removal,),
        batch_size=batch_size,
        seed=seed,
        progress=progress,
        resume={removal: resume} if resume is not None else None,
        contrasts=contrasts,
        task=task,
        skipped=skipped,
        checkpoint=None if checkpoint is None else (lambda parts: checkpoint(parts[removal])),
        checkpoint_every=checkpoint_every,
    )[removal]


def evaluate_removals(
    lens,
    texts: Sequence[str],
    methods: Sequence[str] | None = None,
    *,
    removals: Sequence[str] = ("delete",),
    batch_size: int = 8,
    seed: int = 0,
    progress: Callable[[float, int], None] | None = None,
    resume: dict[str, Evaluation] | None = None,
    contrasts: Sequence[Contrast] | None = None,
    task: str = "faithfulness",
    skipped: dict[str, dict[str, int]] | None = None,
    checkpoint: Callable[[dict[str, Evaluation]], object] | None = None,
    checkpoint_every: float | None = None,
) -> dict[str, Evaluation]:
    """`evaluate` for several removal rules at once: the attributions are computed once and shared. Each
    Evaluation's timings are what a run of its removal alone would have spent (the shared part plus its own
    perturbed forwards and bookkeeping). Ctrl-C raises `Interrupted` with the examples finished so far;
    `checkpoint(partial)` receives them, per removal, at most every `checkpoint_every` seconds (see `evaluate`)."""
    from mixlens import __version__

    t_start = time.perf_counter()
    texts = list(texts)
    if not texts:
        raise MixlensError("no examples to evaluate (the data file is empty?)")
    for removal in removals:
        if removal not in REMOVALS:
            raise MixlensError(f"unknown removal '{removal}'; valid: {', '.join(REMOVALS)}")
    mask_id = lens.tokenizer.mask_token_id
    if "mask" in removals and mask_id is None:
        raise MixlensError("--removal mask needs a model with a mask token; this tokenizer has none (use delete)")
    kind = explained_kind(lens.model)
    family = lens.adapter.family
    if contrasts is not None:
        contrasts = list(contrasts)
        if len(contrasts) != len(texts):
            raise MixlensError(f"{len(contrasts)} contrasts for {len(texts)} texts; give one per text")
        if kind != "causal":
            raise MixlensError(f"the {task} task explains a causal LM's next token; this model is {KIND_NAMES[kind]}")
    chosen = list(methods) if methods else attr.default_methods(kind, family)
    real = attr.check_methods(kind, [m for m in chosen if m != RANDOM], family)
    left = [m for m in attr.applicable(kind) if m not in real]
    slow = [m for m in left if get_method(m).slow]
    notes = [f"not evaluated: {', '.join(left)}"] if left else []
    if slow:
        notes.append(
            f"left out of the default set (too slow on long runs: n·d forward-mode JVPs per input): {', '.join(slow)}"
        )
    all_methods = [*real, RANDOM]
    rng = np.random.default_rng(seed)
    shared: dict[str, float] = {}  # seconds per method (attributions)
    own = {r: {"forward": 0.0, "removal": 0.0} for r in removals}  # per removal: perturbed forwards, the rest
    examples: dict[str, list[Example]] = {r: [] for r in removals}
    kept = _resumed(resume, removals, all_methods, seed, texts, task)
    for r in removals:
        examples[r] = list(resume[r].examples[:kept]) if resume and kept else []
    for e in examples[removals[0]]:
        rng.random(len(e.ids))  # the random baseline continues as in one uninterrupted run
    if kept and resume:
        notes += [n for n in resume[removals[0]].notes if n.startswith("truncated")]
        notes.append(f"resumed: the first {kept} examples come from an interrupted run (timings cover this run only)")
    cut: list[str] = []
    finished = float(kept)

    def build() -> dict[str, Evaluation]:
        total_shared = time.perf_counter() - t_start - sum(o["removal"] for o in own.values())
        n = len(examples[removals[0]])
        extra = [f"interrupted after {n} of {len(texts)} examples; the metrics cover those"] if n < len(texts) else []
        if cut:
            extra.append(
                "truncated to the model's limit (scores and f cover the kept tokens; `text` is whole): "
                + "; ".join(cut[:20])
                + (f" and {len(cut) - 20} more" if len(cut) > 20 else "")
            )
        for m in real:
            bad = sum(not np.isfinite(e.scores[m]).all() for e in examples[removals[0]])
            if bad:
                extra.append(f"{m}: non-finite scores (overflow) on {bad} of {n} inputs; its ranks are arbitrary")
        out = {}
        for removal in removals:
            t = {**shared, "forward": own[removal]["forward"], "total": total_shared + own[removal]["removal"]}
            t["attributions"] = sum(v for k, v in shared.items() if k in real)
            t["own"] = t["total"] - t["attributions"] - t["forward"]
            out[removal] = Evaluation(
                lens.name,
                __version__,
                removal,
                all_methods,
                examples[removal],
                seed,
                t,
                [*notes, *extra],
                task,
                dict(skipped or {}),
            )
        return out

    saved = [time.perf_counter()]
    every = CHECKPOINT_EVERY if checkpoint_every is None else checkpoint_every

    def batch_done() -> None:
        if checkpoint is not None and time.perf_counter() - saved[0] >= every:
            checkpoint(build())
            saved[0] = time.perf_counter()

    try:
        _run_batches(
            lens,
            texts[kept:],
            None if contrasts is None else contrasts[kept:],
            kept,
            batch_size,
            real,
            all_methods,
            removals,
            rng,
            seed,
            mask_id,
            shared,
            own,
            examples,
            cut,
            finished,
            len(texts),
            progress,
            batch_done,
        )
    except KeyboardInterrupt:
        raise Interrupted(build() if examples[removals[0]] else {}, len(texts)) from None
    return build()


def _resumed(
    resume: dict[str, Evaluation] | None,
    removals: Sequence[str],
    methods: list[str],
    seed: int,
    texts: list[str],
    task: str = "faithfulness",
) -> int:
    """How many leading examples of `resume` this run keeps; a resume of another run is a `MixlensError`."""
    if not resume:
        return 0
    kept = None
    for r in removals:
        ev = resume.get(r)
        if ev is None or ev.removal != r or ev.methods != methods or ev.seed != seed or ev.task != task:
            raise MixlensError(
                "the interrupted evaluation to resume was made with other methods, removal or seed "
                f"({', '.join(ev.methods) if ev else 'none'}; seed {ev.seed if ev else '-'}); "
                "use another --out or delete it"
            )
        got = [e.text for e in ev.examples]
        if got != texts[: len(got)]:
            raise MixlensError("the interrupted evaluation to resume holds other texts; use another --out or delete it")
        kept = len(got) if kept is None else min(kept, len(got))
    return kept or 0


def _run_batches(
    lens,
    texts: list[str],
    contrasts: list[Contrast] | None,
    offset: int,
    batch_size: int,
    real: list[str],
    all_methods: list[str],
    removals: Sequence[str],
    rng: np.random.Generator,
    seed: int,
    mask_id: int | None,
    shared: dict[str, float],
    own: dict[str, dict[str, float]],
    examples: dict[str, list[Example]],
    cut: list[str],
    finished: float,
    total: int,
    progress: Callable[[float, int], None] | None,
    batch_done: Callable[[], None],
) -> None:
    """The work of `evaluate_removals` over `texts` (input numbers from `offset`): examples appended per batch,
    `batch_done()` after each."""
    steps = len(real) + 1 + len(removals)  # progress parts of a batch: each method, the reference, each removal
    for bt in lens.batches(texts, batch_size, trace=real, output=True):
        for k, n in enumerate(bt.enc.truncated):
            if n:
                cut.append(f"input {offset + bt.index[k] + 1} {n} → {len(bt.enc.tokens[k])} tokens")
        report_truncated(bt, offset)
        assert bt.trace is not None  # trace=real
        enc, chunk = bt.enc, [texts[b] for b in bt.index]
        ids = [enc.inputs["input_ids"][b, : len(t)].tolist() for b, t in enumerate(enc.tokens)]
        share = len(bt.index) / steps

        def advance(_: str = "", share: float = share) -> None:
            nonlocal finished
            finished += share
            if progress:
                progress(min(finished, total), total)

        mine = None if contrasts is None else [contrasts[b] for b in bt.index]
        request: tuple[attr.Request, attr.Foil] = (
            ("pred", None) if mine is None else (tuple(c.target for c in mine), tuple(c.foil for c in mine))
        )
        targets, ro, f0 = read_targets(lens, bt.trace, *request)
        res = attr.attribute(
            bt.trace,
            ro,
            real,
            target=request[0],
            foil=request[1],
            seed=seed,
            reference=True,
            timings=shared,
            on_method=advance,
        )
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
                    contrast=None if mine is None else mine[b],
                )
            )
        e0 = ro.e0 if ro.e0 is not None else torch.zeros(len(batch), 1)
        batches: dict[str, list[Example]] = {}
        for removal in removals:
            t0 = time.perf_counter()
            done = [replace(e) for e in batch] if len(removals) > 1 else batch
            _perturbed_f(lens, ro, e0, done, all_methods, removal, mask_id, own[removal])
            batches[removal] = done
            own[removal]["removal"] += time.perf_counter() - t0
            advance()
        for removal in removals:  # a batch counts only once every removal has it (an interrupt keeps whole batches)
            examples[removal] += batches[removal]
        batch_done()


def _perturbed_f(
    lens,
    ro,
    e0: torch.Tensor,
    batch: list[Example],
    methods: list[str],
    removal: str,
    mask_id: int | None,
    timings: dict[str, float],
) -> None:
    """Fill each example's `removed` and `kept` f values: every perturbed input of the batch de-duplicated and run
    together, sorted by length (removal 'none': nothing to run, they stay empty)."""
    if removal == NO_REMOVAL:
        return
    seqs: dict[tuple[tuple[int, ...], int], int] = {}  # (sequence, example) → row
    plan = []
    for b, e in enumerate(batch):
        for m in methods:
            for keep, levels in ((False, LEVELS), (True, KS)):
                for k in levels:
                    s = perturb(e.ids, top_k(e.scores[m], e.special, k), e.special, keep, removal, mask_id)
                    plan.append((b, m, keep, k, seqs.setdefault((s, b), len(seqs))))
    t0 = time.perf_counter()
    keys = list(seqs)
    contrast = batch[0].contrast is not None
    owners = [b for _, b in keys]
    fs = _forward_f(lens, ro.kind, ro.pool, [s for s, _ in keys], owners, ro.index, e0, ro.foil if contrast else None)
    timings["forward"] += time.perf_counter() - t0
    for e in batch:
        e.removed = {m: np.zeros(len(LEVELS)) for m in methods}
        e.kept = {m: np.zeros(len(KS)) for m in methods}
    for b, m, keep, k, row in plan:
        if keep:
            batch[b].kept[m][KS.index(k)] = fs[row]
        else:
            batch[b].removed[m][LEVELS.index(k)] = fs[row]


def stderr_progress(done: int, total: int) -> None:
    """Progress on stderr, only on a terminal."""
    if sys.stderr.isatty():
        print(f"\revaluated {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)
