"""`explain`: one score per token and method for a target of each input (see `targets`, `attributions`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from mixlens.batching import Batch
from mixlens.errors import MixlensError
from mixlens.explain import answers as ans
from mixlens.explain import attributions as attr
from mixlens.explain import fits
from mixlens.methods import get as get_method
from mixlens.protocol import LensLike
from mixlens.result import ANSWER_AXES, TOKEN_AXES, Attribution, Explained, Explanation, InputRows
from mixlens.targets import (
    KIND_NAMES,
    Readout,
    Target,
    logit_rows,
    model_kind,
    positions,
    readout,
    resolve_index,
    score,
    token_label,
    trace_output,
)
from mixlens.trace import Trace


def explain(
    lens: LensLike,
    texts: str | Sequence[str],
    methods: Sequence[str] | None = None,
    *,
    target: str | int | None = None,
    foil: str | int | None = None,
    answer: str | Sequence[str] | None = None,
    generate: int = 0,
    batch_size: int = 8,
    seed: int = 0,
    progress: Callable[[float], None] | None = None,
) -> Explanation:
    """Explain `target` (default: the prediction) of each text with `methods` (default: every applicable one
    that is not slow and supports the model's family, from the registry). Inputs run in `lens.batches`; each
    batch's prediction is read from its traced forward pass. `progress(n)` is called with the inputs done (in units
    of inputs, fractions as each method of a batch finishes; they add up to `len(texts)`).

    Answers (causal LMs; `explain.answers`): `answer` (one text for every input, or one per input) explains every
    token of that answer after each text at once; `generate` = N > 0 generates N tokens greedily and explains them
    as the answer. Each method's scores are then an [answer, source] matrix per input (an `Attribution` with axes
    ("target", "source"), its target axis the answer tokens, `Attribution.rows[b]` their positions), the
    answer-level scores their sum over the answer (`Explanation.inputs[b].scores`), and each input's target the
    answer (text, tokens, ids, first position, each token's log-probability)."""
    from mixlens.version import __version__

    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts or any(not isinstance(t, str) or not t.strip() for t in texts):
        raise MixlensError("every input must be a non-empty text")
    kind = explained_kind(lens.model)
    family = lens.adapter.family
    methods = attr.check_methods(kind, list(methods), family) if methods else attr.default_methods(kind, family)
    if generate or answer is not None:
        what = "--generate" if generate else "--answer"
        if kind != "causal":
            raise MixlensError(f"{what} needs a causal language model; this one is {KIND_NAMES[kind]}")
        if target is not None or foil is not None:
            raise MixlensError(f"{what} explains the answer's tokens; drop --target and --foil")
        if generate < 0:
            raise MixlensError(f"--generate must be a positive number of tokens, got {generate}")
        if generate and answer is not None:
            raise MixlensError("give --answer or --generate, not both")
        answers = None if answer is None else [answer] * len(texts) if isinstance(answer, str) else list(answer)
        if answers is not None and len(answers) != len(texts):
            raise MixlensError(f"{len(answers)} answers given for {len(texts)} inputs; give one per input")
        return answers_explanation(lens, texts, methods, answers, generate, seed, progress, __version__)
    if kind == "causal" and (ans.is_phrase(lens, target) or ans.is_phrase(lens, foil)):
        if target is None:
            raise MixlensError("a foil phrase needs a target phrase to contrast: give --target")
        return phrases_explanation(lens, texts, methods, str(target), foil, seed, progress, __version__)
    request = request_of(lens, kind, target, foil)
    timings: dict[str, float] = {}
    done: list[Explained] = []
    one_row = fits.row_only(methods, kind)
    for batch in lens.batches(texts, batch_size):  # tokenised only: each batch's passes are estimated first
        report_truncated(batch)
        chunk = [texts[b] for b in batch.index]
        ids = [batch.enc.inputs["input_ids"][b, : len(t)].tolist() for b, t in enumerate(batch.enc.tokens)]
        share = len(ids) / len(methods)  # inputs done per method

        def advance(_: str, share: float = share) -> None:
            if progress:
                progress(share)

        n_max = int(batch.enc.inputs["input_ids"].shape[1])
        longest = max(range(len(ids)), key=lambda k: len(ids[k]))
        parts = fits.batch_bytes(
            lens, methods, len(ids), n_max, streamed=False, one_row=one_row, reference=False, removal=False
        )
        fits.check_batch(lens, parts, f"input {batch.index[longest] + 1}", n_max)  # before any pass
        trace = lens.trace_for(batch.enc, methods, output=True)
        targets, ro, score = read_targets(lens, trace, *request)
        extras: dict[str, dict[str, torch.Tensor]] = {}
        res = attr.attribute(
            trace,
            ro,
            methods,
            target=request[0],
            foil=request[1],
            seed=seed,
            timings=timings,
            on_method=advance,
            extras=extras,
        )
        p_target, p_foil = probabilities(trace, ro)
        for b, x in enumerate(ids):
            toks = [token_label(lens.tokenizer, t) for t in x]  # as text: ' Paris', not 'ĠParis'
            done.append(
                Explained(
                    chunk[b],
                    toks,
                    targets[b],
                    float(score[b]),
                    {m: res[m][b, : len(x)].numpy() for m in methods},
                    None if p_target is None else float(p_target[b]),
                    None if p_foil is None else float(p_foil[b]),
                    {m: _input_extras(m, ex, b, len(x)) for m, ex in extras.items() if ex},
                )
            )
    return as_explanation(lens.name, __version__, done, request, timings)


def answers_explanation(
    lens: LensLike,
    texts: list[str],
    methods: list[str],
    answers: list[str] | None,
    generate: int,
    seed: int,
    progress: Callable[[float], None] | None,
    version: str,
) -> Explanation:
    """Each text's answer (given, or `generate` tokens generated greedily) explained by `methods`, one input at a
    time (`answers.explain_answer`): an `Explanation` whose attributions have axes ("target", "source")."""
    timings: dict[str, float] = {}
    done: list[Explained] = []
    share = 1 / len(methods)

    def advance(_: str) -> None:
        if progress:
            progress(share)

    for k, text in enumerate(texts):
        where = f" of input {k + 1}" if len(texts) > 1 else ""
        if answers is None:
            head = ans.answer_prompt(lens, text)
            ans.check_length(lens, len(head) + generate, where)
            new = ans.generated(lens, head, generate)
            ids = head + new
            answer = ans.Answer(
                lens.tokenizer.decode(new), new, [token_label(lens.tokenizer, t) for t in new], len(head)
            )
        else:
            ids, answer = ans.tokenized(lens, text, answers[k], where)
            ans.check_length(lens, len(ids), where)
        extras: dict[str, dict[str, np.ndarray]] = {}
        mats = ans.explain_answer(
            lens, ids, answer, methods, seed=seed, timings=timings, on_method=advance, extras=extras
        )
        toks = [token_label(lens.tokenizer, t) for t in ids]
        done.append(
            Explained(
                text,
                toks,
                Target(ans.KIND, -1, answer.text),
                float(sum(answer.logprobs)),
                {m: v.sum(0) for m, v in mats.items()},
                extras={m: e for m, e in extras.items() if e},
                answer=answer.to_json(),
                matrix=mats,
            )
        )
    return as_explanation(lens.name, version, done, (ans.KIND, None), timings)


def phrases_explanation(
    lens: LensLike,
    texts: list[str],
    methods: list[str],
    target: str,
    foil: str | int | None,
    seed: int,
    progress: Callable[[float], None] | None,
    version: str,
) -> Explanation:
    """A multi-token target (and foil) on each text (`answers.explain_phrase`): one score per prompt token and
    method, the target `phrase` with the phrases and their log-probabilities."""
    timings: dict[str, float] = {}
    done: list[Explained] = []
    foil_text = None if foil is None else foil if isinstance(foil, str) else lens.tokenizer.decode([int(foil)])
    for k, text in enumerate(texts):
        where = f" of input {k + 1}" if len(texts) > 1 else ""
        ph = ans.explain_phrase(lens, text, target, foil_text, methods, seed=seed, timings=timings, where=where)
        fo = None if ph.foil is None else ph.foil.text
        done.append(
            Explained(
                text,
                [token_label(lens.tokenizer, t) for t in ph.prompt],
                Target(ans.PHRASE, -1, ph.target.text, None if fo is None else -1, fo),
                ph.score,
                ph.scores,
                extras={m: {"remainder": np.asarray(v, np.float32)} for m, v in ph.remainder.items()},
                answer=None,
                phrase=ph.to_json(),
            )
        )
        if progress:
            progress(1.0)
    return as_explanation(lens.name, version, done, (target, None if foil is None else str(foil)), timings)


def answer_rows(answer: dict[str, Any] | None) -> list[int]:
    """The positions of an explained answer's tokens in its input (the target axis of its attributions)."""
    assert answer is not None
    return list(range(answer["start"], answer["start"] + len(answer["ids"])))


def as_explanation(
    model: str,
    version: str,
    done: list[Explained],
    request: tuple[int | str, int | str | None],
    timings: dict[str, float],
) -> Explanation:
    """The explained inputs as an `Explanation` (an `Analysis`): each method's scores [batch, source], one block per
    input; the request (target, foil) in each method's parameters."""
    tokens = [e.tokens for e in done]
    lengths = [len(t) for t in tokens]
    params = {"target": request[0], "foil": request[1]}
    answered = bool(done) and done[0].answer is not None
    methods = list(done[0].scores) if done else []

    def extras_of(m: str, lead: tuple[str, ...] = ()) -> dict[str, InputRows]:
        dims = get_method(m).extras  # an answer's extras have one row per answer token first (`lead`)
        kept = [k for k in dims if all(k in e.extras.get(m, {}) for e in done)]
        return {
            k: InputRows([(np.array([i]), e.extras[m][k][None]) for i, e in enumerate(done)], lead + dims[k], lengths)
            for k in kept
        }

    if answered:  # [answer, source] per input; the target axis holds the answer tokens (their positions)
        attributions = {
            m: Attribution(
                InputRows([(np.array([k]), e.matrix[m][None]) for k, e in enumerate(done)], ANSWER_AXES, lengths),
                ANSWER_AXES,
                tokens,
                m,
                model,
                dict(params),
                extras=extras_of(m, ("target",)),
                rows=[answer_rows(e.answer) for e in done],
            )
            for m in methods
        }
    else:
        attributions = {
            m: Attribution(
                InputRows([(np.array([k]), e.scores[m][None]) for k, e in enumerate(done)], ("source",), lengths),
                ("source",),
                tokens,
                m,
                model,
                dict(params),
                extras=extras_of(m) if done else {},
            )
            for m in methods
        }
    explained = [
        {
            **e.target.to_json(e.score),
            "index": e.target.index,
            **({} if e.target.foil is None else {"foil_index": e.target.foil}),
            # with a foil the score is g(x); the probabilities are kept beside it (without, score = f(x))
            **(
                {}
                if e.target.foil is None or e.probability is None
                else {"probability": e.probability, "foil_probability": e.foil_probability}
            ),
            **({} if e.answer is None else {"answer": e.answer}),
            **({} if e.phrase is None else {"phrase": e.phrase}),
        }
        for e in done
    ]
    texts = [e.text for e in done]
    return Explanation(model, version, texts, tokens, attributions, {}, None, explained=explained, timings=timings)


def _input_extras(method: str, extras: dict[str, torch.Tensor], b: int, n: int) -> dict[str, np.ndarray]:
    """Input b's secondary outputs of `method`, token axes cut to its n tokens (the registry names their axes)."""
    dims = get_method(method).extras
    out = {}
    for k, v in extras.items():
        axes = dims.get(k)
        if axes is None or v.dim() != len(axes) + 1:
            continue
        cut = tuple(slice(0, n) if a in TOKEN_AXES else slice(None) for a in axes)
        out[k] = v[b][cut].float().numpy()
    return out


def probabilities(trace: Trace, ro: Readout) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The target's and the foil's probability at each input's target position (softmax over the classes or the
    vocabulary), [B] each; None where the model has no logits (encoders) or no foil was given."""
    out = trace_output(trace)
    if ro.kind == "encoder" or out.logits is None or ro.fn is not None:
        return None, None
    rows = logit_rows(ro.kind, out.logits, ro.position).detach().float().softmax(-1).cpu()
    pick = torch.arange(rows.shape[0])
    p_t = rows[pick, ro.index.clamp_min(0)]
    p_f = rows[pick, ro.foil.clamp_min(0)] if bool((ro.foil >= 0).any()) else None
    return p_t, p_f


def explained_kind(model: torch.nn.Module) -> str:
    """The model kind explain and evaluate take: 'classifier', 'causal' or 'encoder'."""
    kind = model_kind(model)
    if kind == "masked":
        raise MixlensError(
            "explain and evaluate take sequence classifiers, causal LMs and base encoders, not a masked LM head; "
            "load the model with head='sequence-classification', 'causal-lm' or 'base'"
        )
    return kind


def request_of(
    lens: LensLike, kind: str, target: str | int | None, foil: str | int | None
) -> tuple[int | str, int | None]:
    """(target, foil) as the methods' options take them: 'pred' or a class / token id, and None or an id."""
    t: int | str = "pred" if target is None else resolve_index(kind, lens.model.config, lens.tokenizer, target)
    f = None if foil is None else resolve_index(kind, lens.model.config, lens.tokenizer, foil)
    return t, f


def read_targets(
    lens: LensLike, trace: Trace, target: attr.Request, foil: attr.Foil
) -> tuple[list[Target], Readout, torch.Tensor]:
    """The targets of a traced batch, read from its forward pass: (targets, readout, f(x) [B], or the contrast g(x)
    when a foil is given). A trace that kept the logits of some positions only (`Trace.logit_at`) is read there
    when they hold each input's default target position (a causal LM's last token), else from a plain forward."""
    out, row_at = None, None
    if trace.logit_at is not None and trace.logits is not None:
        pos = positions(model_kind(lens.model), trace.inputs, lens.tokenizer, None).to(trace.logit_at.device)
        k = torch.searchsorted(trace.logit_at, pos).clamp_max(len(trace.logit_at) - 1)
        if bool((trace.logit_at[k] == pos).all()):
            out, row_at = SimpleNamespace(logits=trace.logits, last_hidden_state=None), k
    out = trace_output(trace) if out is None else out
    targets, ro = readout(lens.model, lens.tokenizer, out, trace.inputs, target, foil, row_at=row_at)
    index, fo, position, e0 = ro.tensors()
    g, f = score(ro.kind, ro.pool, out, trace.inputs["attention_mask"], index, fo, position, e0, row_at, ro.logprob)
    return targets, ro, (g if foil is not None else f).detach().float().cpu()


def report_truncated(batch: Batch, offset: int = 0) -> None:
    """Say on stderr which inputs were cut to the model's limit (their `text` stays whole in the output); input
    numbers count from 1, plus `offset`."""
    for k, n in enumerate(batch.enc.truncated):
        if n:
            print(
                f"warning: input {offset + batch.index[k] + 1} truncated from {n} to {len(batch.enc.tokens[k])} tokens",
                file=sys.stderr,
            )
