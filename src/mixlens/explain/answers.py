"""Answers: every token of a causal LM's answer explained at once, from one forward pass of prompt + answer.

An answer of m tokens after a prompt of p tokens is one input of p + m tokens (teacher forcing: the answer is fed,
not sampled). Answer token a sits at position p + a and is predicted at position p + a − 1; row a of a method's
answer matrix [answer, source] is that method's explanation of answer token a given prompt + answer[:a] — exactly
the single-token explanation of the input prompt + answer[:a] with target answer[a], since a causal LM's states
at a position do not depend on later tokens (its sources after p + a − 1 are 0). The answer-level scores are the
sum of the rows.

The scalar of row a (`targets.Request`): its log-probability log p(answer[a] | prompt, answer[:a]) for the methods
that read a scalar from the model's output (gradients, perturbations), its logit for the methods that decompose a
logit (`logit_attn`, `alti_logit`, `decompx_logit`, `attnlrp`); the maps (attention, rollouts, flow routes) give
the row of the predicting position p + a − 1 (docs/reference/answers.md).

Cost: the decompositions read every row from the one traced forward; the gradient family runs one forward of
prompt + answer and one backward per answer token (batched, `saliency.gradient_rows`); maps that compute target
rows (`Method.row_mode`) build only the m answer rows, streamed layer by layer.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mixlens.errors import MixlensError
from mixlens.explain.attributions import options_for
from mixlens.methods import get
from mixlens.methods.alti_logit import LogitTerms
from mixlens.methods.saliency import gradient_rows, keeps_logits
from mixlens.pipeline import run_methods, stream_trace
from mixlens.protocol import LensLike
from mixlens.result import TOKEN_AXES
from mixlens.targets import Request, token_label
from mixlens.trace import run_traced

KIND = "answer"  # the `Target.kind` of an explained answer
PHRASE = "phrase"  # the `Target.kind` of a multi-token target (and foil) of a causal LM


@dataclass
class Answer:
    """One input's answer: its text (as explained: the decoded answer tokens), token ids and labels, the position of
    its first token in prompt + answer (`start` = the prompt's token count), and each token's log-probability
    under teacher forcing (filled by `explain_answer`)."""

    text: str
    ids: list[int]
    tokens: list[str]
    start: int
    logprobs: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "ids": list(self.ids),
            "tokens": list(self.tokens),
            "start": self.start,
            "logprobs": [float(v) for v in self.logprobs],
        }

    @property
    def positions(self) -> list[int]:
        """The positions the answer tokens are predicted at (the token before each), in prompt + answer."""
        return [self.start - 1 + a for a in range(len(self.ids))]


def prompt_ids(lens: LensLike, prompt: str) -> list[int]:
    """The prompt's token ids as `explain` reads it (the model's special tokens included); over-long: one line."""
    enc = lens.encode([prompt], truncate=False)
    return enc.inputs["input_ids"][0, : len(enc.tokens[0])].tolist()


def answer_prompt(lens: LensLike, prompt: str) -> list[int]:
    """The prompt's ids that an answer follows (`prompt_ids` without appended special tokens, `strip_end`)."""
    return strip_end(lens, prompt_ids(lens, prompt))


def strip_end(lens: LensLike, ids: list[int]) -> list[int]:
    """`ids` without the special tokens a tokenizer appends to every text ([SEP], an end token): an answer
    continues the prompt's text, so they are not between the two."""
    special = set(lens.tokenizer.all_special_ids)
    end = len(ids)
    while end > 1 and ids[end - 1] in special:
        end -= 1
    return ids[:end]


def tokenized(lens: LensLike, prompt: str, answer: str, where: str = "") -> tuple[list[int], Answer]:
    """(prompt + answer ids, the answer): the answer's tokens are those of tokenize(prompt + answer) after the
    prompt's own tokens, as the model reads the two together. Where that differs from tokenize(answer) (a token
    merged across the boundary, a different split), one warning line says which tokens are explained."""
    if not isinstance(answer, str) or not answer.strip():
        raise MixlensError(f"the answer{where} is empty; give the text the model answered")
    head, full = strip_end(lens, prompt_ids(lens, prompt)), strip_end(lens, prompt_ids(lens, prompt + answer))
    start = 0
    while start < min(len(head), len(full)) and head[start] == full[start]:
        start += 1
    ids = full[start:]
    if start < 1 or not ids:
        raise MixlensError(
            f"the answer{where} adds no token after the prompt's {len(head)} tokens "
            "(it merges with the prompt's end); start it with a space or give a longer answer"
        )
    alone = lens.tokenizer(answer, add_special_tokens=False)["input_ids"]
    labels = [token_label(lens.tokenizer, t) for t in ids]
    if start < len(head) or list(alone) != ids:
        print(
            f"warning: the answer{where} is tokenized differently after the prompt; explaining the tokens "
            f"{labels} (tokenize(prompt + answer) after the prompt's first {start} tokens), not "
            f"{[token_label(lens.tokenizer, t) for t in alone]}",
            file=sys.stderr,
        )
    return full[:start] + ids, Answer(lens.tokenizer.decode(ids), ids, labels, start)


@torch.no_grad()
def generated(lens: LensLike, ids: list[int], n: int) -> list[int]:
    """n tokens generated greedily after `ids` (one forward per token, with the model's key-value cache)."""
    model = lens.model
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # transformers 5
    x = torch.tensor([ids], device=lens.device)
    past: Any = None
    new: list[int] = []
    for _ in range(n):
        mask = torch.ones(1, len(ids) + len(new), dtype=torch.long, device=lens.device)
        last = {"logits_to_keep": 1} if keeps_logits(model) else {}  # the prompt's step: not [n, vocabulary]
        out = model(
            input_ids=x, attention_mask=mask, use_cache=True, **last, **({key: past} if past is not None else {})
        )
        past = getattr(out, key, None)
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
        x = torch.tensor([[tok]], device=lens.device)
    return new


def check_length(lens: LensLike, n: int, where: str = "") -> None:
    """An input of prompt + answer past the model's context: one line."""
    if n > lens.max_length:
        raise MixlensError(
            f"prompt + answer{where} is {n} tokens, past the model's context of {lens.max_length} tokens"
        )


def row_requests(answer: Answer, logprob: bool = True) -> list[Request]:
    """One resolved request per answer token: its id, read at the position before it (batch of one input)."""
    return [Request((t,), (-1,), (p,), logprob) for t, p in zip(answer.ids, answer.positions, strict=True)]


def explain_answer(
    lens: LensLike,
    ids: list[int],
    answer: Answer,
    methods: Sequence[str],
    *,
    seed: int = 0,
    timings: dict[str, float] | None = None,
    on_method: Callable[[str], None] | None = None,
    extras: dict[str, dict[str, np.ndarray]] | None = None,
) -> dict[str, np.ndarray]:
    """Each method's answer matrix [answer, source] (source: all len(ids) tokens of prompt + answer) for one input,
    and `answer.logprobs` filled. Methods that build target rows (`Method.row_mode`) share one streamed forward
    that builds only the answer rows; a method declaring `Method.layered_rows` adds its answer rows' terms up in that
    pass too, layer by layer (`alti_logit.LogitTerms`), unless another method reads the whole trace; every other method
    shares one traced forward (or, reading the inputs alone, none) whose rows it reads. `extras`, when given,
    receives each token-score method's per-row secondary outputs without a token axis (e.g. the decompositions'
    `remainder`), [answer, *axes]."""
    timings = timings if timings is not None else {}
    rows = answer.positions
    requests = row_requests(answer)
    n = len(ids)
    enc = lens.encode_ids([ids])
    streamed = [m for m in methods if get(m).row_mode and get(m).dims != ("source",)]
    others = [m for m in methods if m not in streamed]
    # logit_attn's rows stream too (its terms added layer by layer), unless another method reads the whole trace
    layered = [m for m in others if get(m).layered_rows]
    if not all(get(m).inputs_only for m in others if m not in layered):
        layered = []
    others = [m for m in others if m not in layered]
    out: dict[str, np.ndarray] = {}
    filled = False  # answer.logprobs
    dev = enc.inputs["input_ids"].device
    # the logits of the answer positions only (a vocabulary row per position is the largest part of a long trace)
    at = torch.tensor(sorted(set(rows)), device=dev) if keeps_logits(lens.model) else None
    if streamed or layered:  # with no other method, this pass also gives the answer's log-probabilities
        terms = LogitTerms(lens.adapter, lens.model, 0, torch.tensor(rows, device=dev), answer.ids)
        sink = terms.add if layered else None
        if streamed:
            rowed = stream_trace(
                lens.adapter, lens.model, enc.inputs, streamed, rows, lens.tokenizer, None, not others, at, sink
            )
        else:
            with torch.no_grad():
                rowed = run_traced(
                    lens.adapter, lens.model, enc.inputs, tokenizer=lens.tokenizer, sink=sink, qk_rows=True, logit_at=at
                )
        if rowed.logits is not None:
            answer.logprobs, filled = logprobs(lens, rowed, ids, answer), True
        for name in layered:
            t0 = time.perf_counter()
            d = terms.finish(rowed.logit_rows(torch.tensor(rows), 0), lens.model, name, "the answer")
            out[name] = d.heads.sum((1, 2)).cpu().numpy()  # [answer, source]
            if extras is not None:
                extras[name] = {"mlp": d.mlp.cpu().numpy(), "remainder": d.remainder.cpu().numpy()}
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
            if on_method:
                on_method(name)
        for name in streamed:
            t0 = time.perf_counter()
            v = run_methods(rowed, [name], rows=rows).values[name]  # [1, layer, K, n]
            out[name] = v[0, -1].float().cpu().numpy()
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
            if on_method:
                on_method(name)
        del rowed, terms
    trace = lens.trace_for(enc, others, output=True, logit_at=at) if others else None
    if trace is not None:
        gradient_rows(trace, [m for m in others if get(m).inputs_only], requests)
    for name in others:
        assert trace is not None
        spec = get(name)
        t0 = time.perf_counter()
        if spec.dims == ("source",):
            keys = {o.name for o in spec.options}
            mat = np.zeros((len(rows), n), np.float32)
            kept: dict[str, list[np.ndarray]] = {}
            for a, (req, pos) in enumerate(zip(requests, rows, strict=True)):
                if "target" in keys:
                    opts = options_for(name, req, None, seed)
                else:
                    opts = {
                        **options_for(name, "pred", None, seed),
                        **({"position": pos} if "position" in keys else {}),
                    }
                step = run_methods(trace, [name], options={name: opts})
                mat[a] = step.values[name][0].float().cpu().numpy()
                for k, v in step.extras.get(name, {}).items():
                    if not set(spec.extras.get(k, ("token",))) & set(TOKEN_AXES):  # per-row scalars: remainder…
                        kept.setdefault(k, []).append(v[0].float().cpu().numpy())
            out[name] = mat
            if extras is not None:
                extras[name] = {k: np.stack(v) for k, v in kept.items()}
        else:  # a map [layer, target, source] over every row: its answer rows of the last layer
            v = run_methods(trace, [name]).values[name]
            out[name] = v[0, -1, rows].float().cpu().numpy()
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
        if on_method:
            on_method(name)
    if not filled:  # the streamed pass gave no logits: the full trace's, else a plain forward
        answer.logprobs = logprobs(lens, trace, ids, answer)
    return out


@torch.no_grad()
def logprobs(lens: LensLike, trace: Any, ids: list[int], answer: Answer) -> list[float]:
    """log p(answer[a] | prompt, answer[:a]) per answer token, from the trace's logits (else one plain forward)."""
    pos = torch.tensor(answer.positions)
    if trace is not None and trace.logits is not None:
        rows = trace.logit_rows(pos.to(trace.logits.device), 0).float().log_softmax(-1)
    elif keeps_logits(lens.model):  # the answer's positions only, not [n, vocabulary] (262k wide on gemma-3)
        rows = lens.model(**lens.encode_ids([ids]).inputs, logits_to_keep=pos).logits[0].float().log_softmax(-1)
    else:
        rows = lens.model(**lens.encode_ids([ids]).inputs).logits[0, pos].float().log_softmax(-1)
    return rows[torch.arange(len(answer.ids)), torch.tensor(answer.ids, device=rows.device)].cpu().tolist()


def is_phrase(lens: LensLike, spec: object) -> bool:
    """Whether a causal LM's `--target` / `--foil` is a phrase of several tokens (not an id, not one vocabulary
    entry, not a text of one token)."""
    if not isinstance(spec, str) or not spec.strip() or spec.strip().isdigit() or spec in lens.tokenizer.get_vocab():
        return False
    return len(lens.tokenizer(spec, add_special_tokens=False)["input_ids"]) > 1


@dataclass
class Phrase:
    """A phrase target (and foil) explained on one prompt: `scores` per method over the prompt's tokens (Σ over the
    target phrase's rows minus Σ over the foil phrase's), `within` per method the part on the phrases' own earlier
    tokens (target's minus foil's), `remainder` per method the decompositions' remainders summed likewise, and the
    phrases (`Answer`s, each teacher-forced on its own continuation of the prompt)."""

    prompt: list[int]
    target: Answer
    foil: Answer | None
    scores: dict[str, np.ndarray]
    within: dict[str, float]
    remainder: dict[str, float]

    @property
    def score(self) -> float:
        """Σ log p(target phrase) − Σ log p(foil phrase) (teacher forcing)."""
        return float(sum(self.target.logprobs) - (sum(self.foil.logprobs) if self.foil is not None else 0.0))

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target.to_json(),
            "foil": None if self.foil is None else self.foil.to_json(),
            "within": {m: float(v) for m, v in self.within.items()},
        }


def explain_phrase(
    lens: LensLike,
    prompt: str,
    target: str,
    foil: str | None,
    methods: Sequence[str],
    *,
    seed: int = 0,
    timings: dict[str, float] | None = None,
    where: str = "",
) -> Phrase:
    """A multi-token target (minus a foil phrase) on one prompt: each phrase explained as an answer of the prompt
    (`explain_answer`: row a teacher-forced on prompt + phrase[:a]), its rows summed. The two phrases share only
    the prompt's tokens as sources, so the contrast's per-token scores are over the prompt; what each phrase's rows
    put on the phrase's own earlier tokens is kept as `within`. For the decompositions Σ scores + within +
    remainder is exactly Σ logit(target phrase) − Σ logit(foil phrase)."""
    parts = []
    for spec in (target, foil):
        if spec is None:
            continue
        ids, ans = tokenized(lens, prompt, spec, where)
        check_length(lens, len(ids), where)
        extras: dict[str, dict[str, np.ndarray]] = {}
        mats = explain_answer(lens, ids, ans, methods, seed=seed, timings=timings, extras=extras)
        parts.append((ids, ans, mats, extras))
    start = parts[0][1].start
    if any(p[1].start != start for p in parts):
        raise MixlensError(
            f"the target and foil phrases{where} merge differently with the prompt's end; start both with a space"
        )
    scores: dict[str, np.ndarray] = {}
    within: dict[str, float] = {}
    rest: dict[str, float] = {}
    for m in methods:
        signs = zip((1.0, -1.0), parts, strict=False)
        terms = [(s, p[2][m], p[3].get(m, {}).get("remainder")) for s, p in signs]
        scores[m] = np.sum([s * mat[:, :start].sum(0) for s, mat, _ in terms], axis=0)
        within[m] = float(sum(s * float(mat[:, start:].sum()) for s, mat, _ in terms))
        remainders = [(s, r) for s, _, r in terms if r is not None]
        if len(remainders) == len(terms):
            rest[m] = float(sum(s * float(np.sum(r)) for s, r in remainders))
    return Phrase(parts[0][0][:start], parts[0][1], parts[1][1] if foil is not None else None, scores, within, rest)
