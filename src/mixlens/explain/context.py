"""`mixlens evaluate --task context`: does an explanation of a causal LM's answer point at the passage of the context
that holds it? (docs/guides/explain-and-evaluate.md, docs/findings/context.md)

Data: the JSONL of `scripts/context_task.py` (or any file of the same fields): per line a `prompt` of N passages, the
`answer` (the model's continuation is " " + answer), `gold` (the index of the passage that states it, from 0) and
`passages` ([start, end) character spans of each passage in the prompt, disjoint).

- the answer's tokens: those that " " + answer adds to the prompt's tokens (the prompt's tokens must stay the same
  once it is appended, else the line is refused: the answer is not a continuation of the prompt);
- answered correctly: at every answer position the answer's token is the argmax of the model's next-token logits
  given the prompt and the answer's earlier tokens (teacher forcing; the same as greedy generation producing the
  answer's tokens). Only those prompts are scored; the others are counted;
- a method's token scores for answer token a: its explanation of answer[a] at the position before it, the
  answer API's [answer, source] matrix (`answers.explain_answer`: one forward pass of prompt + answer; the
  decompositions explain the logit, the gradient methods the log-probability); a passage's score = the sum over
  the answer's tokens of the sum over its tokens (`segments.segmentation`: each token belongs to
  the passage its characters overlap most) — an exact sum of token scores;
- rank of the gold passage among the N passages by score (descending; ties: earlier passage first); MRR = mean of
  1 / rank, top-1 = share of rank 1, each with its 95 % bootstrap interval over the scored prompts;
- references: leave-one-passage-out (the drop of the answer's summed log-probability, teacher-forced, when the
  passage's characters and the whitespace after them are removed from the prompt: N + 1 forward passes), a seeded
  random draw (uniform scores per passage) and the random ranking's expectation, computed exactly: E[MRR] = H_N / N,
  E[top-1] = 1 / N (mean over the scored prompts).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixlens import jsonio
from mixlens.errors import MixlensError
from mixlens.explain import answers as ans
from mixlens.explain import attributions as attr
from mixlens.explain.evaluation import bootstrap
from mixlens.explain.explain import explained_kind
from mixlens.explain.segments import Segmentation, segmentation
from mixlens.methods import get as get_method
from mixlens.methods import registry
from mixlens.targets import KIND_NAMES, token_label

TASK = "context"
LOO = "leave_one_out"
RANDOM = "random"
EXPECTED = "random_expected"
FIELDS = ("prompt", "answer", "gold", "passages")


# ------------------------------------------------------------------------------------------------------ the data


@dataclass(frozen=True)
class Prompt:
    """One line of the task's JSONL: its id, prompt, answer (without the leading space), gold passage index and the
    passages' [start, end) character spans; `line`: its line number in the file (from 1)."""

    id: object
    prompt: str
    answer: str
    gold: int
    passages: tuple[tuple[int, int], ...]
    line: int

    @property
    def continuation(self) -> str:
        """The text the model continues the prompt with: " " + answer."""
        return " " + self.answer


def _check_line(doc: object, where: str, k: int) -> Prompt:
    if not isinstance(doc, dict):
        raise MixlensError(f"{where}: not a JSON object (the task's lines hold {', '.join(FIELDS)})")
    missing = [f for f in FIELDS if f not in doc]
    if missing:
        raise MixlensError(f"{where}: no field {', '.join(missing)} (each line needs {', '.join(FIELDS)})")
    prompt, answer, gold, spans = (doc[f] for f in FIELDS)
    if not isinstance(prompt, str) or not prompt.strip():
        raise MixlensError(f"{where}: 'prompt' must be a non-empty string")
    if not isinstance(answer, str) or not answer.strip() or answer != answer.strip():
        raise MixlensError(f"{where}: 'answer' must be a non-empty string without surrounding whitespace")
    if not isinstance(spans, list) or len(spans) < 2:
        raise MixlensError(f"{where}: 'passages' must be a list of at least 2 [start, end] character spans")
    out: list[tuple[int, int]] = []
    for j, s in enumerate(spans):
        if not isinstance(s, list) or len(s) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in s):
            raise MixlensError(f"{where}: passage {j} is not a [start, end] pair of integers")
        a, b = s
        if not 0 <= a < b <= len(prompt):
            raise MixlensError(
                f"{where}: passage {j} [{a}, {b}) is empty or outside the prompt of {len(prompt)} characters"
            )
        if out and a < out[-1][1]:
            raise MixlensError(
                f"{where}: passage {j} [{a}, {b}) overlaps or precedes passage {j - 1}; give disjoint spans in order"
            )
        out.append((a, b))
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(out):
        raise MixlensError(f"{where}: 'gold' is {gold!r}, not a passage index from 0 to {len(out) - 1}")
    return Prompt(doc.get("id", k), prompt, answer, gold, tuple(out), k)


def read_prompts(path: Path, skip: int = 0, limit: int = 0) -> list[Prompt]:
    """The task's prompts of a JSONL file (the first `limit` after `skip`; 0 = all), every line checked: a line that
    is not a JSON object with the task's fields, spans outside the prompt or overlapping, or a gold index out of
    range is a `MixlensError` naming the line."""
    if path.is_dir():
        raise MixlensError(f"data '{path}' is a directory; --task context reads a JSONL file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise MixlensError(f"cannot read '{path}': {e.strerror or e}") from None
    out: list[Prompt] = []
    for k, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}: line {k}"
        try:
            doc = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MixlensError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
        out.append(_check_line(doc, where, k))
    out = out[skip : skip + limit if limit else None]
    if not out:
        raise MixlensError(f"no prompts in '{path}'" + (f" after skipping {skip}" if skip else ""))
    return out


@dataclass(frozen=True)
class Tokens:
    """A prompt's token ids (the model's special tokens added), the answer's token ids and the passages as token
    ranges (`segments`)."""

    prompt: list[int]
    answer: list[int]
    segments: Segmentation


def prompt_tokens(tokenizer, text: str) -> tuple[list[int], int]:
    """The tokens of `text` as the model reads a prompt: the tokenizer's leading special tokens (a BOS) and the
    text's tokens, without trailing special tokens (an EOS or [SEP] a tokenizer appends: the answer follows); and
    the number of leading special tokens."""
    with_special = list(tokenizer(text)["input_ids"])
    plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    for lead in range(len(with_special) - len(plain) + 1):
        if with_special[lead : lead + len(plain)] == plain:
            return with_special[: lead + len(plain)], lead
    raise MixlensError("the tokenizer's special tokens do not surround the text's tokens; cannot place the answer")


def tokenize(tokenizer, p: Prompt, max_tokens: int | None = None, where: str = "") -> Tokens:
    """The prompt's and the answer's tokens; an answer that changes the prompt's tokens once appended (not a
    continuation of the prompt), or a prompt + answer over `max_tokens`, is a `MixlensError`."""
    where = where or f"line {p.line}"
    prompt_ids, lead = prompt_tokens(tokenizer, p.prompt)
    plain = prompt_ids[lead:]
    full = list(tokenizer(p.prompt + p.continuation, add_special_tokens=False)["input_ids"])
    if full[: len(plain)] != plain or len(full) == len(plain):
        raise MixlensError(
            f"{where}: the answer {p.continuation!r} is not a continuation of the prompt for this tokenizer (the "
            "prompt's tokens change once it is appended)"
        )
    answer = full[len(plain) :]
    if max_tokens is not None and len(prompt_ids) + len(answer) - 1 > max_tokens:
        raise MixlensError(
            f"{where}: the prompt and answer take {len(prompt_ids) + len(answer) - 1} tokens, over the model's "
            f"limit of {max_tokens}"
        )
    labelled = [(f"passage {j + 1}", a, b) for j, (a, b) in enumerate(p.passages)]
    seg = segmentation(tokenizer, p.prompt, labelled)
    if seg.input_ids[: len(prompt_ids)] != prompt_ids:  # the same encoding; cannot differ for one tokenizer
        raise MixlensError(f"{where}: the passages' tokenization differs from the prompt's")
    return Tokens(prompt_ids, answer, seg)


def passage_scores(tokens: Tokens, scores: np.ndarray) -> np.ndarray:
    """[answer, source] token scores → [answer, passage]: each passage's tokens summed (exact sums, float64)."""
    n, m = len(tokens.prompt), len(tokens.segments.input_ids)
    x = np.zeros((scores.shape[0], m))
    x[:, :n] = scores[:, :n]  # trailing special tokens of the segmentation's encoding (none are read): 0
    return tokens.segments.scores(x)


# ------------------------------------------------------------------------------------------- forward passes


def answer_logprobs(lens, prompt_ids: list[int], answer_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """One forward pass of prompt + answer[:-1]: each answer token's log-probability given the prompt and the answer's
    earlier tokens (teacher forcing) [A], and whether it is the argmax there [A] (bool)."""
    ids = torch.tensor([prompt_ids + answer_ids[:-1]], device=lens.device)
    a = len(answer_ids)
    with torch.no_grad(), sdpa(lens.model):
        logits = lens.model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=a).logits[0, -a:]
    logp = logits.float().log_softmax(-1)
    want = torch.tensor(answer_ids, device=logp.device)
    got = logp.gather(1, want[:, None])[:, 0]
    return got.cpu().numpy().astype(np.float64), (logp.argmax(-1) == want).cpu().numpy()


@contextlib.contextmanager
def sdpa(model: Any) -> Iterator[None]:
    """Run plain forward passes with torch's fused attention (no [n, n] weights per head kept, as eager keeps: an
    8k-token prompt in bounded memory); the model's attention implementation is restored after."""
    before = getattr(model.config, "_attn_implementation", "eager")
    if before == "sdpa":
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def without_passage(prompt: str, span: tuple[int, int]) -> str:
    """The prompt without the passage's characters and the whitespace right after them."""
    a, b = span
    rest = prompt[b:]
    return prompt[:a] + rest[len(rest) - len(rest.lstrip()) :]


def leave_one_out(lens, p: Prompt, tokens: Tokens, base: float) -> np.ndarray:
    """Per passage the drop of the answer's summed log-probability (`base` − with the passage removed, the same
    answer tokens teacher-forced) [N]. The N forward passes share the prompt's key/value cache up to where each
    shortened prompt's tokens first differ from the prompt's (causal attention: those positions are the same), so
    each pass runs only from there: the prefix is computed once, in order, and copied for each passage."""
    model, a_len = lens.model, len(tokens.answer)
    removed = [prompt_tokens(lens.tokenizer, without_passage(p.prompt, span))[0] for span in p.passages]
    starts = [min(_common(tokens.prompt, ids), len(ids) - 1) for ids in removed]  # ≥ 1 token runs

    def tensor(ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], device=lens.device)

    drops = np.zeros(len(removed))
    cache, done = None, 0
    want = torch.tensor(tokens.answer, device=lens.device)
    with torch.no_grad(), sdpa(model):
        for k in sorted(range(len(removed)), key=lambda k: starts[k]):
            if starts[k] > done:  # extend the shared prefix
                cache = model(
                    input_ids=tensor(tokens.prompt[done : starts[k]]),
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                ).cache
                done = starts[k]
            rest = removed[k][done:] + tokens.answer[:-1]
            out = model(input_ids=tensor(rest), cache=copy.deepcopy(cache), use_cache=True, logits_to_keep=a_len)
            logp = out.logits[0, -a_len:].float().log_softmax(-1).gather(1, want[:, None])[:, 0]
            drops[k] = base - float(logp.double().sum())
    return drops


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def token_scores(
    lens,
    prompt_ids: list[int],
    answer_ids: list[int],
    methods: Sequence[str],
    *,
    seed: int = 0,
    timings: dict[str, float] | None = None,
    cpu: dict[str, float] | None = None,
) -> dict[str, np.ndarray]:
    """Per method the [answer, source] matrix of the answer's tokens after the prompt (source = prompt + answer; an
    answer token's row is 0 from its own position on): `answers.explain_answer`, one forward pass of prompt + answer
    (decompositions explain each answer token's logit, gradients its log-probability: docs/reference/answers.md).
    Each method runs alone, so that `timings` / `cpu` accumulate what it costs by itself: wall-clock and CPU
    seconds of its call, its forward (and backward) passes included."""
    timings = timings if timings is not None else {}
    cpu = cpu if cpu is not None else {}
    labels = [token_label(lens.tokenizer, t) for t in answer_ids]
    out = {}
    for m in methods:
        answer = ans.Answer(lens.tokenizer.decode(answer_ids), list(answer_ids), labels, len(prompt_ids))
        t0, c0 = time.perf_counter(), time.process_time()
        out[m] = np.asarray(
            ans.explain_answer(lens, prompt_ids + list(answer_ids), answer, [m], seed=seed)[m], dtype=np.float64
        )
        timings[m] = timings.get(m, 0.0) + time.perf_counter() - t0
        cpu[m] = cpu.get(m, 0.0) + time.process_time() - c0
    return out


def answer_token_scores(lens, prompt: str, answer: str, methods: Sequence[str]) -> dict[str, np.ndarray]:
    """Per method the [answer token, source token] scores of `answer` (the continuation's text, e.g. " 4721") after
    `prompt` (`token_scores`; source = the prompt's tokens and the answer's)."""
    prompt_ids, lead = prompt_tokens(lens.tokenizer, prompt)
    full = list(lens.tokenizer(prompt + answer, add_special_tokens=False)["input_ids"])
    plain = prompt_ids[lead:]
    if full[: len(plain)] != plain or len(full) == len(plain):
        raise MixlensError(f"the answer {answer!r} is not a continuation of the prompt for this tokenizer")
    return token_scores(lens, prompt_ids, full[len(plain) :], methods)


# ---------------------------------------------------------------------------------------------------- metrics


def gold_rank(scores: np.ndarray, gold: int) -> int:
    """Rank (from 1) of passage `gold` by score, descending; ties: earlier passage first; nan scores last."""
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=-np.inf)
    g = s[gold]
    return 1 + int((s > g).sum()) + int((s[:gold] == g).sum())


def expected_random(n: int) -> tuple[float, float]:
    """(E[1 / rank], P[rank = 1]) of the gold passage under a uniformly random ranking of n passages: H_n / n, 1 / n."""
    return sum(1.0 / k for k in range(1, n + 1)) / n, 1.0 / n


@dataclass
class Example:
    """One prompt's result: whether the model answered it correctly and, if so, each method's passage scores per
    answer token [answer, passage], the leave-one-out drops [passage], the random draw [passage] and seconds spent."""

    id: object
    text: str
    answer: str
    answer_ids: list[int]
    gold: int
    n_passages: int
    n_tokens: int
    logprobs: list[float]
    correct: bool
    scores: dict[str, np.ndarray] = field(default_factory=dict)  # method → [answer, passage]
    loo: np.ndarray | None = None  # [passage]
    random: np.ndarray | None = None  # [passage]
    seconds: dict[str, float] = field(default_factory=dict)  # wall clock, per method, leave_one_out and total
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds of this process, the same keys

    @property
    def references(self) -> list[str]:
        """The references this prompt has: leave-one-out (unless the run left it out) and random."""
        return [LOO, RANDOM] if self.loo is not None else [RANDOM]

    def ranked(self, method: str) -> np.ndarray:
        """The passages' scores a ranking uses: summed over the answer tokens (methods), or the reference's [N]."""
        if method == LOO:
            assert self.loo is not None
            return self.loo
        if method == RANDOM:
            assert self.random is not None
            return self.random
        return self.scores[method].sum(0)

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "text": self.text,
            "answer": self.answer,
            "answer_ids": self.answer_ids,
            "gold": self.gold,
            "n_passages": self.n_passages,
            "n_tokens": self.n_tokens,
            "logprobs": self.logprobs,
            "correct": self.correct,
            "passage_scores": {m: v.tolist() for m, v in self.scores.items()},
            "leave_one_out": None if self.loo is None else self.loo.tolist(),
            "random": None if self.random is None else self.random.tolist(),
            "ranks": {m: gold_rank(self.ranked(m), self.gold) for m in [*self.scores, *self.references]}
            if self.correct
            else {},
            "seconds": self.seconds,
            "cpu_seconds": self.cpu,
        }

    @classmethod
    def from_json(cls, d: dict) -> Example:
        def arr(v: object) -> np.ndarray | None:
            return None if v is None else np.array(v, dtype=np.float64)

        return cls(
            d["id"],
            str(d["text"]),
            str(d["answer"]),
            [int(t) for t in d["answer_ids"]],
            int(d["gold"]),
            int(d["n_passages"]),
            int(d["n_tokens"]),
            [float(v) for v in d["logprobs"]],
            bool(d["correct"]),
            {
                m: np.array(v, dtype=np.float64).reshape(len(d["answer_ids"]), int(d["n_passages"]))
                for m, v in d["passage_scores"].items()
            },
            arr(d["leave_one_out"]),
            arr(d["random"]),
            {k: float(v) for k, v in d["seconds"].items()},
            {k: float(v) for k, v in d.get("cpu_seconds", {}).items()},
        )


@dataclass
class ContextEvaluation:
    """The task's run: the model, the methods, every prompt's `Example` (correct or not) and the run's identity."""

    model: str
    version: str
    methods: list[str]
    examples: list[Example]
    seed: int
    total: int  # prompts of the run (examples may be fewer: interrupted)
    run: dict[str, object]
    notes: list[str] = field(default_factory=list)

    @property
    def scored(self) -> list[Example]:
        return [e for e in self.examples if e.correct]

    @property
    def references(self) -> list[str]:
        """Leave-one-out (unless the run left it out: `--removal none`) and random."""
        return [LOO, RANDOM] if self.run.get("leave_one_out", True) else [RANDOM]

    def metrics(self) -> dict[str, dict[str, object]]:
        """Per method and reference: MRR and top-1 over the scored prompts with their 95 % bootstrap intervals, and
        the mean seconds per scored prompt; the random ranking's exact expectation under `EXPECTED`."""
        ex = self.scored
        out: dict[str, dict[str, object]] = {}
        for m in [*self.methods, *self.references]:
            rr = np.array([1.0 / gold_rank(e.ranked(m), e.gold) for e in ex])
            top = (rr == 1.0).astype(float)
            secs = [e.seconds.get(m, float("nan")) for e in ex]
            cpus = [e.cpu.get(m, float("nan")) for e in ex]
            out[m] = {
                "n": len(ex),
                "mrr": float(rr.mean()) if len(ex) else float("nan"),
                "top1": float(top.mean()) if len(ex) else float("nan"),
                "ci95": {"mrr": bootstrap(rr, self.seed), "top1": bootstrap(top, self.seed)},
                "seconds_per_prompt": float(np.mean(secs)) if len(ex) else float("nan"),
                "cpu_seconds_per_prompt": float(np.mean(cpus)) if len(ex) else float("nan"),
            }
        exp = [expected_random(e.n_passages) for e in ex]
        out[EXPECTED] = {
            "n": len(ex),
            "mrr": float(np.mean([x[0] for x in exp])) if ex else float("nan"),
            "top1": float(np.mean([x[1] for x in exp])) if ex else float("nan"),
        }
        return out

    def counts(self) -> dict[str, int]:
        done = len(self.examples)
        right = len(self.scored)
        return {"prompts": self.total, "done": done, "answered_correctly": right, "wrong": done - right}

    def to_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "version": self.version,
            "task": TASK,
            "run": self.run,
            "methods": self.methods,
            "counts": self.counts(),
            "metrics": self.metrics(),
            "notes": self.notes,
            "definitions": {
                "correct": "teacher-forced argmax at every answer token (= greedy generation of the answer's tokens)",
                "passage_score": "sum over the answer's tokens and the passage's tokens of the method's token scores",
                "rank": "of the gold passage by score, descending; ties: earlier passage first",
                LOO: "drop of the answer's summed log-probability when the passage (and the whitespace after it) "
                "is removed; N + 1 forward passes",
                RANDOM: "uniform random scores per passage, seeded",
                EXPECTED: "exact: MRR = H_N / N, top-1 = 1 / N, averaged over the scored prompts",
                "seconds": "wall-clock seconds per scored prompt: each method run alone (its forward and backward "
                "passes included), leave_one_out its N + 1 forward passes; cpu_seconds: this process's CPU time "
                "for the same",
                "bootstrap_resamples": 1000,
                "seed": self.seed,
            },
            "examples": [e.to_json() for e in self.examples],
        }

    def dumps(self) -> str:
        """Strict JSON: a non-finite number (an undefined metric) is written as null and named in a note."""
        from mixlens.jsonio import finite, summarize_paths

        doc, where = finite(self.to_json())
        if where:
            doc["notes"].append(f"{len(where)} numbers are not finite ({summarize_paths(where)}); written as null")
        return json.dumps(doc, allow_nan=False)

    @classmethod
    def from_json(cls, doc: dict) -> ContextEvaluation:
        return cls(
            str(doc["model"]),
            str(doc["version"]),
            [str(m) for m in doc["methods"]],
            [Example.from_json(e) for e in doc["examples"]],
            int(doc["definitions"]["seed"]),
            int(doc["counts"]["prompts"]),
            dict(doc["run"]),
            [n for n in doc["notes"] if not n.endswith("written as null")],
        )

    def table(self) -> str:
        """A markdown table: per method and reference MRR and top-1 with their intervals and seconds per prompt."""
        met = self.metrics()
        c = self.counts()
        tokens = [e.n_tokens for e in self.scored]
        head = (
            f"Context attribution — {self.model}: {c['answered_correctly']} of {c['done']} prompts answered "
            f"correctly and scored"
            + (f" ({c['done']} of {c['prompts']} done)" if c["done"] < c["prompts"] else "")
            + (f"; {min(tokens)}–{max(tokens)} prompt tokens" if tokens else "")
        )
        lines = [
            head,
            "",
            "| method | MRR | 95 % interval | top-1 | 95 % interval | s / prompt | CPU s / prompt |",
            "|---|---|---|---|---|---|---|",
        ]

        def num(v: object) -> str:
            x = float(v)  # type: ignore[arg-type]
            return "–" if not math.isfinite(x) else f"{x:.2f}"

        order = sorted(self.methods, key=lambda m: -np.nan_to_num(float(met[m]["mrr"]), nan=-np.inf))  # type: ignore[arg-type]
        for m in [*order, *self.references]:
            r: Any = met[m]
            lines.append(
                f"| {m} | {num(r['mrr'])} | [{num(r['ci95']['mrr'][0])}, {num(r['ci95']['mrr'][1])}] | "
                f"{num(r['top1'])} | [{num(r['ci95']['top1'][0])}, {num(r['ci95']['top1'][1])}] | "
                f"{num(r['seconds_per_prompt'])} | {num(r['cpu_seconds_per_prompt'])} |"
            )
        e = met[EXPECTED]
        lines.append(f"| random (expected) | {num(e['mrr'])} | | {num(e['top1'])} | | | |")
        return "\n".join(lines)


# -------------------------------------------------------------------------------------------------- the run


def evaluate_context(
    lens,
    prompts: Sequence[Prompt],
    methods: Sequence[str] | None = None,
    *,
    seed: int = 0,
    run: dict[str, object] | None = None,
    resume: ContextEvaluation | None = None,
    checkpoint: Callable[[ContextEvaluation], object] | None = None,
    progress: Callable[[float], None] | None = None,
    on_resume: Callable[[int], object] | None = None,
    with_loo: bool = True,
) -> ContextEvaluation:
    """Run the task on `prompts` with `methods` (default: the ones the registry recommends for a causal LM, as
    `explain` runs on a decoder, that the model's family supports).
    `resume`: an interrupted run of the same `run` identity and prompts: its examples are kept. `checkpoint(ev)` is
    called after every prompt (the CLI saves it); `progress(1)` after every prompt. `with_loo=False`: without
    that reference (its N + 1 forward passes per scored prompt: the costly part at long contexts)."""
    from mixlens import __version__

    kind = explained_kind(lens.model)
    if kind != "causal":
        raise MixlensError(f"the context task explains a causal LM's answer; this model is {KIND_NAMES[kind]}")
    family = lens.adapter.family
    if methods:
        chosen = attr.check_methods(kind, list(methods), family)
    else:
        chosen = [m for m in registry.explainers(kind, recommended=True) if get_method(m).refusal(family) is None]
    prompts = list(prompts)
    tokens = [tokenize(lens.tokenizer, p, lens.max_length) for p in prompts]  # every line checked before any work
    ident = {
        **(run or {}),
        "model": lens.name,
        "dtype": str(lens.model.dtype).removeprefix("torch."),
        "task": TASK,
        "methods": chosen,
        "seed": seed,
        "scores": "answer API, each method alone",  # explain_answer's scalars; per-method timings
    }
    if not with_loo:
        ident["leave_one_out"] = False  # `ContextEvaluation.references`
    examples: list[Example] = []
    if resume is not None:
        diff = [k for k in sorted(set(resume.run) | set(ident)) if resume.run.get(k) != ident.get(k)]
        if diff:
            what = "the data changed" if "data" in diff else f"another run ({', '.join(diff)} differ)"
            raise MixlensError(f"the interrupted evaluation to resume is {what}; use another --out or delete it")
        if [e.text for e in resume.examples] != [p.prompt for p in prompts[: len(resume.examples)]]:
            raise MixlensError(
                "the interrupted evaluation to resume holds other prompts; use another --out or delete it"
            )
        examples = list(resume.examples)
        if on_resume is not None:
            on_resume(len(examples))
    rng = np.random.default_rng(seed)
    for e in examples:
        if e.correct:
            rng.random(e.n_passages)  # the random draw continues as in one uninterrupted run
    notes = [f"resumed: the first {len(examples)} prompts come from an interrupted run"] if examples else []

    def build() -> ContextEvaluation:
        return ContextEvaluation(lens.name, __version__, chosen, list(examples), seed, len(prompts), ident, notes)

    for p, tok in zip(prompts[len(examples) :], tokens[len(examples) :], strict=True):
        t0 = time.perf_counter()
        logp, hit = answer_logprobs(lens, tok.prompt, tok.answer)
        ex = Example(
            p.id,
            p.prompt,
            p.answer,
            tok.answer,
            p.gold,
            len(p.passages),
            len(tok.prompt),
            logp.tolist(),
            bool(hit.all()),
        )
        if ex.correct:
            timings: dict[str, float] = {}
            cpu: dict[str, float] = {}
            c0 = time.process_time()
            scores = token_scores(lens, tok.prompt, tok.answer, chosen, seed=seed, timings=timings, cpu=cpu)
            ex.scores = {m: passage_scores(tok, v) for m, v in scores.items()}
            if with_loo:
                t1, c1 = time.perf_counter(), time.process_time()
                ex.loo = leave_one_out(lens, p, tok, float(logp.sum()))
                timings[LOO], cpu[LOO] = time.perf_counter() - t1, time.process_time() - c1
            ex.random = rng.random(len(p.passages))
            timings["total"], cpu["total"] = time.perf_counter() - t0, time.process_time() - c0
            ex.seconds, ex.cpu = timings, cpu
        examples.append(ex)
        if checkpoint is not None:
            checkpoint(build())
        if progress is not None:
            progress(1.0)
    return build()


def read_saved(path: Path) -> tuple[ContextEvaluation, bool] | None:
    """The context evaluation saved at `path` and whether it is an interrupted one (None when there is none); a file
    that is not one is a `MixlensError`."""
    if not path.is_file():
        if path.exists():
            raise MixlensError(f"'{path}' is not a regular file; use another --out")
        return None
    doc = jsonio.read(path)
    if doc.get("task") != TASK:
        raise MixlensError(f"{path} holds an evaluation of another task ({doc.get('task')!r}); use another --out")
    try:
        ev = ContextEvaluation.from_json(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise MixlensError(
            f"cannot resume from {path}: a damaged or edited file ({type(e).__name__}: {e}); delete it or use "
            "another --out"
        ) from None
    ev.notes = [n for n in ev.notes if not n.startswith("resumed:")]
    return ev, "interrupted" in doc
