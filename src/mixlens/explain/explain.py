"""`explain`: one score per token and method for a target of each input (see `targets`, `attributions`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import numpy as np
import torch

from mixlens.batching import Batch
from mixlens.errors import MixlensError
from mixlens.explain import attributions as attr
from mixlens.methods import get as get_method
from mixlens.protocol import LensLike
from mixlens.result import TOKEN_AXES, Attribution, Explained, Explanation, InputRows
from mixlens.targets import (
    KIND_NAMES,
    Readout,
    Target,
    logit_rows,
    model_kind,
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
    generate: int = 0,
    batch_size: int = 8,
    seed: int = 0,
    progress: Callable[[float], None] | None = None,
) -> Explanation:
    """Explain `target` (default: the prediction) of each text with `methods` (default: every applicable one
    that is not slow and supports the model's family, from the registry). `generate` = N > 0 (causal LMs): generate
    N tokens greedily, explaining each by its context. Inputs run in `lens.batches`; each batch's prediction is
    read from its traced forward pass. `progress(n)` is called with the inputs done (in units of inputs, fractions
    as each method and generated token of a batch finishes; they add up to `len(texts)`)."""
    from mixlens.version import __version__

    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts or any(not isinstance(t, str) or not t.strip() for t in texts):
        raise MixlensError("every input must be a non-empty text")
    kind = explained_kind(lens.model)
    family = lens.adapter.family
    methods = attr.check_methods(kind, list(methods), family) if methods else attr.default_methods(kind, family)
    if generate:
        if kind != "causal":
            raise MixlensError(f"--generate needs a causal language model; this one is {KIND_NAMES[kind]}")
        if target is not None:
            raise MixlensError("--generate explains the generated tokens; drop --target")
        if generate < 0:
            raise MixlensError(f"--generate must be a positive number of tokens, got {generate}")
    request = request_of(lens, kind, target, foil)
    timings: dict[str, float] = {}
    done: list[Explained] = []
    for batch in lens.batches(texts, batch_size, trace=methods, output=True):
        report_truncated(batch)
        chunk = [texts[b] for b in batch.index]
        ids = [batch.enc.inputs["input_ids"][b, : len(t)].tolist() for b, t in enumerate(batch.enc.tokens)]
        if generate and max(len(x) for x in ids) + generate > lens.max_length:
            raise MixlensError(
                f"--generate {generate} runs past the model's context of {lens.max_length} tokens "
                f"(the longest input has {max(len(x) for x in ids)})"
            )
        trace = batch.trace
        share = len(ids) / (len(methods) * max(1, generate))  # inputs done per method and step

        def advance(_: str, share: float = share) -> None:
            if progress:
                progress(share)

        for step in range(max(1, generate)):
            if trace is None:
                trace = lens.trace_for(lens.encode_ids(ids), methods, output=True)
            assert trace is not None
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
                text = chunk[b] if step == 0 else lens.tokenizer.decode(x)
                done.append(
                    Explained(
                        text,
                        toks,
                        targets[b],
                        float(score[b]),
                        {m: res[m][b, : len(x)].numpy() for m in methods},
                        None if p_target is None else float(p_target[b]),
                        None if p_foil is None else float(p_foil[b]),
                        {m: _input_extras(m, ex, b, len(x)) for m, ex in extras.items() if ex},
                    )
                )
            if generate:
                ids = [x + [t.index] for x, t in zip(ids, targets, strict=True)]
                trace = None
    return as_explanation(lens.name, __version__, done, request, timings)


def as_explanation(
    model: str, version: str, done: list[Explained], request: tuple[int | str, int | None], timings: dict[str, float]
) -> Explanation:
    """The explained inputs as an `Explanation` (an `Analysis`): each method's scores [batch, source], one block per
    input; the request (target, foil) in each method's parameters."""
    tokens = [e.tokens for e in done]
    lengths = [len(t) for t in tokens]
    params = {"target": request[0], "foil": request[1]}
    methods = list(done[0].scores) if done else []

    def extras_of(m: str) -> dict[str, InputRows]:
        dims = get_method(m).extras
        kept = [k for k in dims if all(k in e.extras.get(m, {}) for e in done)]
        return {
            k: InputRows([(np.array([i]), e.extras[m][k][None]) for i, e in enumerate(done)], dims[k], lengths)
            for k in kept
        }

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
    when a foil is given)."""
    out = trace_output(trace)
    targets, ro = readout(lens.model, lens.tokenizer, out, trace.inputs, target, foil)
    g, f = score(ro.kind, ro.pool, out, trace.inputs["attention_mask"], *ro.tensors())
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
