"""`explain`: one score per token and method for a target of each input (see `targets`, `attributions`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from mixlens.errors import MixlensError
from mixlens.explain import attributions as attr
from mixlens.explain.targets import Target, model_kind, resolve


@dataclass
class Explained:
    """One explained input: tokens, target, its score (f(x), or g(x) for a contrast) and scores per method."""

    text: str
    tokens: list[str]
    target: Target
    score: float
    scores: dict[str, np.ndarray]  # method → [n] one float per token

    def to_json(self) -> dict[str, object]:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "target": self.target.to_json(self.score),
            "scores": {m: [float(v) for v in s] for m, s in self.scores.items()},
        }


@dataclass
class Explanation:
    """Explanations of several inputs; `.show()` prints them, `.to_json()`, `.html()`, `_repr_html_` for notebooks."""

    model: str
    version: str
    methods: list[str]
    inputs: list[Explained]
    timings: dict[str, float] = field(default_factory=dict)  # seconds per method

    def to_json(self) -> dict[str, object]:
        return {"model": self.model, "version": self.version, "inputs": [e.to_json() for e in self.inputs]}

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    def html(self) -> str:
        from mixlens.viz.highlight import render_page

        return render_page(self)

    def _repr_html_(self) -> str:
        from mixlens.viz.highlight import render_fragment

        return render_fragment(self)

    def show(self, console=None) -> None:
        from mixlens.viz.highlight import print_terminal

        print_terminal(self, console)


def pad_batch(lens, ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-padded model inputs for token-id lists (single segments: token_type_ids 0 where the model has them)."""
    n = max(len(x) for x in ids)
    pad = lens.tokenizer.pad_token_id or 0
    input_ids = torch.full((len(ids), n), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), n), dtype=torch.long)
    for b, x in enumerate(ids):
        input_ids[b, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[b, : len(x)] = 1
    out = {"input_ids": input_ids, "attention_mask": mask}
    if "token_type_ids" in lens.tokenizer.model_input_names:
        out["token_type_ids"] = torch.zeros_like(input_ids)
    return {k: v.to(lens.device) for k, v in out.items()}


def explain(
    lens,
    texts: str | Sequence[str],
    methods: Sequence[str] | None = None,
    *,
    target: str | int | None = None,
    foil: str | int | None = None,
    generate: int = 0,
    batch_size: int = 8,
    seed: int = 0,
) -> Explanation:
    """Explain `target` (default: the prediction) of each text with `methods` (default: every applicable one
    but exact HTA). `generate` = N > 0 (causal LMs): generate N tokens greedily, explaining each by its context."""
    from mixlens import __version__

    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts or any(not isinstance(t, str) or not t.strip() for t in texts):
        raise MixlensError("every input must be a non-empty text")
    kind = model_kind(lens.model)
    methods = attr.check_methods(kind, list(methods) if methods else attr.default_methods(kind))
    if generate:
        if kind != "causal":
            raise MixlensError(f"--generate needs a causal language model; this one is a {kind}")
        if target is not None:
            raise MixlensError("--generate explains the generated tokens; drop --target")
        if generate < 0:
            raise MixlensError(f"--generate must be a positive number of tokens, got {generate}")
    timings: dict[str, float] = {}
    done: list[Explained] = []
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        enc = lens.encode(chunk)
        ids = [enc.inputs["input_ids"][b, : len(t)].tolist() for b, t in enumerate(enc.tokens)]
        for step in range(max(1, generate)):
            inputs = pad_batch(lens, ids)
            targets, ro, score = resolve(lens, inputs, target, foil)
            res = attr.attribute(lens, inputs, ro, methods, seed=seed, timings=timings)
            for b, x in enumerate(ids):
                toks = lens.tokenizer.convert_ids_to_tokens(x)
                text = chunk[b] if step == 0 else lens.tokenizer.decode(x)
                done.append(
                    Explained(
                        text, toks, targets[b], float(score[b]), {m: res[m][b, : len(x)].numpy() for m in methods}
                    )
                )
            if generate:
                ids = [x + [t.index] for x, t in zip(ids, targets, strict=True)]
    return Explanation(lens.name, __version__, methods, done, timings)
