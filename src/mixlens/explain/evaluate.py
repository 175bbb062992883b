"""`evaluate`: which explanation to trust, by removing the tokens it ranks highest (docs/findings/evaluate.md).

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
The inputs may stream (any iterable, e.g. `evidence.stream` over a task file): each batch is drawn from them only
when the previous one is done, so the first example starts at once and memory stays flat in the input count.

Contrastive tasks with evidence (`mixlens.explain.evidence`, e.g. BLiMP): each input brings its own target and foil
token; f(x) is then the logit difference logit(target) − logit(foil) at the last token, the same definitions apply
to it, and each example also keeps its evidence positions (alignment: reciprocal rank, `evidence.reciprocal_rank`).

This module runs the batch loop; the parts live by role: `evaluation` (the data model and the metrics), `scoring`
(the perturbed forward passes) and `checkpoint` (saving and resuming a run). Their public names are re-exported.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace

import numpy as np
import torch

from mixlens.batching import check_texts
from mixlens.errors import MixlensError
from mixlens.explain import attributions as attr
from mixlens.explain import checkpoint as ckpt
from mixlens.explain import fits, scoring
from mixlens.explain.checkpoint import CHECKPOINT_EVERY, Interrupted
from mixlens.explain.evaluation import (
    AOPC_KS,
    KS,
    LEVELS,
    METRICS,
    NO_REMOVAL,
    NULL_NOTE,
    RANDOM,
    REMOVAL_METRICS,
    REMOVALS,
    RESAMPLES,
    Contrast,
    Evaluation,
    Example,
    bootstrap,
    spearman,
)
from mixlens.explain.explain import explained_kind, read_targets, report_truncated
from mixlens.explain.scoring import FORWARD_TOKENS, perturb, top_k
from mixlens.memory import release
from mixlens.methods import get as get_method
from mixlens.methods.saliency import keeps_logits
from mixlens.targets import KIND_NAMES
from mixlens.trace import f32

STREAM = True  # a causal LM's row-mode methods read a streamed trace, and without a method that reads a trace its
# targets come from one fused pass with the last tokens' logits (False: a kept trace, a plain pass; tests' oracle)

__all__ = [
    "AOPC_KS",
    "CHECKPOINT_EVERY",
    "FORWARD_TOKENS",
    "KS",
    "LEVELS",
    "METRICS",
    "NO_REMOVAL",
    "NULL_NOTE",
    "RANDOM",
    "REMOVALS",
    "REMOVAL_METRICS",
    "RESAMPLES",
    "Contrast",
    "Evaluation",
    "Example",
    "Interrupted",
    "bootstrap",
    "evaluate",
    "evaluate_removals",
    "perturb",
    "spearman",
    "stderr_progress",
    "top_k",
]


def evaluate(
    lens,
    texts: Iterable[str],
    methods: Sequence[str] | None = None,
    *,
    removal: str = "delete",
    batch_size: int = 8,
    seed: int = 0,
    progress: Callable[[float, int], None] | None = None,
    resume: Evaluation | None = None,
    contrasts: Iterable[Contrast] | None = None,
    task: str = "faithfulness",
    skipped: dict[str, dict[str, int]] | None = None,
    checkpoint: Callable[[Evaluation], object] | None = None,
    checkpoint_every: float | None = None,
    run: dict[str, object] | None = None,
    on_resume: Callable[[int], object] | None = None,
    total: int | None = None,
) -> Evaluation:
    """Evaluate `methods` (default: every applicable one but exact HTA) plus a seeded random baseline.
    `progress(done, total)`: inputs done (fractions as each method and the perturbed passes of a batch finish).
    `resume`: the `Interrupted.partial` Evaluation (or its JSON, `Evaluation.from_json`) of an interrupted run of
    the same texts, methods, removal and seed: its examples are kept and the run continues after them.
    `contrasts` (a contrastive task named `task`, `mixlens.explain.evidence`): each text's own target, foil and
    evidence; f is then the logit difference; `skipped` counts the task's rows left out, per group and reason.
    `checkpoint(partial)`: called with the Evaluation of the examples finished so far at most every
    `checkpoint_every` seconds (default `CHECKPOINT_EVERY`; after a batch), so that a run killed without warning
    (SIGKILL, a lost machine) can resume from the last one; the CLI writes it as an interrupted evaluation.json.
    `run`: what identifies the run beyond the model, dtype, task, removal, methods and seed (the CLI: the data's
    hash and options); saved as `Evaluation.run`, a `resume` of another run is a `MixlensError`;
    `on_resume(k)` is called once it is found to be the same run, k examples kept.
    `texts` (and `contrasts`, one per text) may be lazy iterables, read one batch at a time (a task file streamed
    by `evidence.stream`; `skipped` then fills as rows are met); `total` is then the expected number of examples
    (at most; for progress and the interrupted marker), the count once they are all read."""
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
        run=run,
        on_resume=on_resume,
        total=total,
    )[removal]


def evaluate_removals(
    lens,
    texts: Iterable[str],
    methods: Sequence[str] | None = None,
    *,
    removals: Sequence[str] = ("delete",),
    batch_size: int = 8,
    seed: int = 0,
    progress: Callable[[float, int], None] | None = None,
    resume: dict[str, Evaluation] | None = None,
    contrasts: Iterable[Contrast] | None = None,
    task: str = "faithfulness",
    skipped: dict[str, dict[str, int]] | None = None,
    checkpoint: Callable[[dict[str, Evaluation]], object] | None = None,
    checkpoint_every: float | None = None,
    run: dict[str, object] | None = None,
    on_resume: Callable[[int], object] | None = None,
    total: int | None = None,
) -> dict[str, Evaluation]:
    """`evaluate` for several removal rules at once: the attributions are computed once and shared. Each
    Evaluation's timings are what a run of its removal alone would have spent (the shared part plus its own
    perturbed forwards and bookkeeping). Ctrl-C raises `Interrupted` with the examples finished so far;
    `checkpoint(partial)` receives them, per removal, at most every `checkpoint_every` seconds (see `evaluate`)."""
    from mixlens import __version__

    t_start = time.perf_counter()
    for removal in removals:
        if removal not in REMOVALS:
            raise MixlensError(f"unknown removal '{removal}'; valid: {', '.join(REMOVALS)}")
    mask_id = lens.tokenizer.mask_token_id
    if "mask" in removals and mask_id is None:
        raise MixlensError("--removal mask needs a model with a mask token; this tokenizer has none (use delete)")
    kind = explained_kind(lens.model)
    family = lens.adapter.family
    if contrasts is not None:
        if isinstance(texts, Sequence) and isinstance(contrasts, Sequence) and len(contrasts) != len(texts):
            raise MixlensError(f"{len(contrasts)} contrasts for {len(texts)} texts; give one per text")
        if kind != "causal":
            raise MixlensError(f"the {task} task explains a causal LM's next token; this model is {KIND_NAMES[kind]}")
    if isinstance(texts, Sequence):
        check_texts(texts)  # every input refused or accepted before the first batch runs
    source = Inputs(texts, contrasts, total)
    if not source.peek():
        raise MixlensError("no examples to evaluate (the data file is empty?)")
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
    runs = {r: ckpt.identity(lens, task=task, removal=r, methods=all_methods, seed=seed, extra=run) for r in removals}
    head = source.head(max((len(ev.examples) for ev in resume.values()), default=0) if resume else 0)
    given = None if contrasts is None else [c for _, c in head if c is not None]
    kept = ckpt.resumed(resume, removals, runs, [t for t, _ in head], given)
    source.replay(head[kept:])
    if resume and on_resume is not None:
        on_resume(kept)
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
        extra = (
            [f"interrupted after {n} of {source.total()} examples; the metrics cover those"]
            if not source.done(n)
            else []
        )
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
                runs[removal],
            )
        return out

    saved = [time.perf_counter()]
    every = ckpt.CHECKPOINT_EVERY if checkpoint_every is None else checkpoint_every

    def batch_done() -> None:
        if checkpoint is not None and time.perf_counter() - saved[0] >= every:
            checkpoint(build())
            saved[0] = time.perf_counter()

    try:
        run_batches(
            lens,
            source.rest(),
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
            source,
            progress,
            batch_done,
        )
    except KeyboardInterrupt:
        raise Interrupted(build() if examples[removals[0]] else {}, source.total()) from None
    return build()


class Inputs:
    """The examples of a run, (text, contrast or None) pairs, drawn from a list or a lazy iterable only as asked
    for; counts them as they are drawn (`total`: the expected count until the last is read, then the count)."""

    def __init__(self, texts: Iterable[str], contrasts: Iterable[Contrast] | None, total: int | None) -> None:
        self.sized = isinstance(texts, Sequence)
        self.expected = len(texts) if isinstance(texts, Sequence) else total
        self.drawn = 0
        self.exhausted = False
        self._it = self._pairs(iter(texts), None if contrasts is None else iter(contrasts))
        self._back: list[tuple[str, Contrast | None]] = []

    def _pairs(
        self, texts: Iterator[str], contrasts: Iterator[Contrast] | None
    ) -> Iterator[tuple[str, Contrast | None]]:
        for t in texts:
            c = None if contrasts is None else next(contrasts, None)
            if contrasts is not None and c is None:
                raise MixlensError(f"fewer contrasts than texts ({self.drawn} for more); give one per text")
            self.drawn += 1
            yield t, c
        if contrasts is not None and next(contrasts, None) is not None:
            raise MixlensError(f"more contrasts than texts ({self.drawn}); give one per text")
        self.exhausted = True

    def head(self, k: int) -> list[tuple[str, Contrast | None]]:
        """The next `k` examples (fewer at the end), taken off the stream."""
        return list(itertools.islice(self.rest(), k))

    def peek(self) -> bool:
        """Whether there is at least one example (it stays in the stream)."""
        first = self.head(1)
        self.replay(first)
        return bool(first)

    def replay(self, items: list[tuple[str, Contrast | None]]) -> None:
        """Put `items` (taken by `head`) back in front of the stream (before `rest` is called for the run)."""
        self._back = [*items, *self._back]

    def rest(self) -> Iterator[tuple[str, Contrast | None]]:
        """The examples not taken yet (an iterator that may be left unfinished: the stream stays open)."""
        while self._back:
            yield self._back.pop(0)
        for item in self._it:  # noqa: UP028 (`yield from` would close the stream with this iterator)
            yield item

    def total(self) -> int:
        """The number of examples: counted once all are read, else the expected count (at least those read)."""
        return self.drawn if self.exhausted else max(self.expected or 0, self.drawn)

    def done(self, n: int) -> bool:
        """Whether `n` finished examples are all of them (a list: its length; a stream: once it is read to its end)."""
        return n >= self.drawn if self.exhausted else self.sized and n >= (self.expected or 0)


def run_batches(
    lens,
    items: Iterator[tuple[str, Contrast | None]],
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
    source: Inputs,
    progress: Callable[[float, int], None] | None,
    batch_done: Callable[[], None],
) -> None:
    """The work of `evaluate_removals` over `items` (text, contrast or None; input numbers from `offset`), drawn
    one batch at a time: examples appended per batch, `batch_done()` after each."""
    steps = len(real) + 1 + len(removals)  # progress parts of a batch: each method, the reference, each removal
    kind = explained_kind(lens.model)
    readers = [m for m in real if not get_method(m).inputs_only]  # the methods that read the traced pass
    own_passes = [m for m in real if m not in readers]  # those running their own passes from the inputs
    # a causal LM's explained row is each input's last token: methods computing that row alone read a streamed
    # trace (`pipeline.stream_trace`: no layer's tensors kept), the others an inputs-only one
    streamed = STREAM and kind == "causal" and bool(readers) and all(get_method(m).row_mode for m in readers)
    one_row = fits.row_only(real, kind)
    perturbed = any(r != NO_REMOVAL for r in removals)
    while group := list(itertools.islice(items, batch_size)):
        texts = [t for t, _ in group]
        (bt,) = lens.batches(texts, batch_size)  # one batch of the inputs drawn, tokenised: no pass has run
        for k, n in enumerate(bt.enc.truncated):
            if n:
                cut.append(f"input {offset + bt.index[k] + 1} {n} → {len(bt.enc.tokens[k])} tokens")
        report_truncated(bt, offset)
        enc, chunk = bt.enc, [texts[b] for b in bt.index]
        n_max = int(enc.inputs["input_ids"].shape[1])
        longest = max(range(len(enc.tokens)), key=lambda k: len(enc.tokens[k]))
        contrast = group[bt.index[longest]][1]
        b = len(bt.index)
        parts = fits.batch_bytes(lens, real, b, n_max, streamed=streamed, one_row=one_row, removal=perturbed)
        where = f"input {offset + bt.index[longest] + 1}"
        fits.check_batch(lens, parts, where, n_max, None if contrast is None else contrast.group)  # before any pass
        last = torch.unique(enc.inputs["attention_mask"].sum(-1) - 1) if keeps_logits(lens.model) else None
        if streamed:
            trace = lens.trace_for(enc, readers, rows=[-1], output=True, logit_at=last)  # logits of the last tokens
            inputs_only = lens.trace_for(enc, own_passes or [attr.REFERENCE_METHOD])  # no pass: the inputs
        elif STREAM and not readers and kind == "causal" and last is not None:  # no method reads a trace
            trace = inputs_only = lens.trace_for(enc, real)
            with scoring.fused(lens.model, kind), torch.no_grad():  # one plain pass, the last tokens' logits
                trace.logits = f32(lens.model(**enc.inputs, logits_to_keep=last).logits)
            trace.logit_at = last
        else:
            trace = inputs_only = lens.trace_for(enc, real, output=True)
        ids = [enc.inputs["input_ids"][b, : len(t)].tolist() for b, t in enumerate(enc.tokens)]
        share = len(bt.index) / steps

        def advance(_: str = "", share: float = share) -> None:
            nonlocal finished
            finished += share
            if progress:
                progress(min(finished, source.total()), source.total())

        mine = None if group[0][1] is None else [group[b][1] for b in bt.index]
        request: tuple[attr.Request, attr.Foil] = (
            ("pred", None) if mine is None else (tuple(c.target for c in mine), tuple(c.foil for c in mine))
        )
        targets, ro, f0 = read_targets(lens, trace, *request)
        res: dict[str, torch.Tensor] = {}
        passes = [(trace, readers, False), (inputs_only, own_passes, True)] if streamed else [(trace, real, True)]
        for tr, names, reference in passes:
            res.update(
                attr.attribute(
                    tr,
                    ro,
                    names,
                    target=request[0],
                    foil=request[1],
                    seed=seed,
                    reference=reference,
                    timings=shared,
                    on_method=advance,
                )
            )
        del trace, inputs_only  # the perturbed passes read the readout only
        release(n_max)  # a long input: what the trace and the gradient passes freed, back to the system first
        batch = []
        for b, x in enumerate(ids):
            sc = {m: res[m][b, : len(x)].numpy() for m in real}
            sc[RANDOM] = rng.random(len(x))
            batch.append(
                Example(
                    chunk[b],
                    enc.tokens[b],
                    x,
                    scoring.special_mask(lens, x),
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
            scoring.perturbed_f(lens, ro, e0, done, all_methods, removal, mask_id, own[removal])
            batches[removal] = done
            own[removal]["removal"] += time.perf_counter() - t0
            advance()
        for removal in removals:  # a batch counts only once every removal has it (an interrupt keeps whole batches)
            examples[removal] += batches[removal]
        offset += len(group)
        batch_done()


def stderr_progress(done: int, total: int) -> None:
    """Progress on stderr, only on a terminal."""
    if sys.stderr.isatty():
        print(f"\revaluated {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)
