"""`Explanation`: what `mixlens.explain` computed, an `Analysis` of one score per token and method for each input's
target, and `Explained`, one explained input as the views read it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mixlens.result import segmented, views
from mixlens.result.analysis import Analysis
from mixlens.result.segmented import Segment


@dataclass
class Explained:
    """One explained input, as the views read it: tokens, target, its score (f(x), or g(x) for a contrast) and one
    score per token for each method ([n])."""

    text: str
    tokens: list[str]
    target: Any  # mixlens.targets.Target
    score: float
    scores: dict[str, np.ndarray]
    probability: float | None = None  # the target's probability (classes or vocabulary), when the model has logits
    foil_probability: float | None = None
    extras: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # method → its secondary outputs
    # an explained answer (`explain(..., answer=)`): the answer (text, ids, tokens, start, logprobs), each method's
    # matrix [answer, source]; `scores` are then the answer-level scores, the matrix summed over the answer
    answer: dict[str, Any] | None = None
    matrix: dict[str, np.ndarray] = field(default_factory=dict)
    # a multi-token target (and foil) of a causal LM: each phrase (as an answer) and the part on its own tokens
    phrase: dict[str, Any] | None = None
    segments: list[Segment] | None = None  # its segments (explain --chat / --span / --marker / --separator)


ANSWER_AXES = ("target", "source")  # an answer's attribution: answer tokens × every token of prompt + answer


class Explanation(Analysis):
    """What `mixlens.explain` computed: one score per token and method (`[batch, source]`) for the target of each
    input (`explained[b]`: kind, label, score — f(x), or g(x) with a foil — and the foil's label). It is an
    `Analysis`: `save` / `Analysis.load` / `concat` / `mixlens report --from`; `.show()` prints it, `.html()` is a
    self-contained page, `_repr_html_` the notebook view. `timings`: seconds per method (not saved)."""

    timings: dict[str, float]
    # per input, its segments (`mixlens.result.segmented`): None where none were asked for; saved, loaded and
    # written to JSON with the explanation, their scores derived from the token scores (exact sums)
    segments: list[list[Segment]] | None = None

    def __init__(self, *args: Any, timings: dict[str, float] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.timings = dict(timings or {})

    @property
    def methods(self) -> list[str]:
        """The methods explained, in the order they ran."""
        return list(self.attributions)

    @property
    def inputs(self) -> list[Explained]:
        """One `Explained` per input: its target and each method's `[source]` scores."""
        from mixlens.targets import Target

        out = []
        for b, t in enumerate(self.explained or []):
            foil = t.get("foil_index", -1) if "foil" in t else None
            target = Target(t["kind"], t.get("index", -1), t["label"], foil, t.get("foil"))
            score = float("nan") if t.get("score") is None else float(t["score"])
            matrix = {m: a.input(b) for m, a in self.attributions.items() if a.dims == ANSWER_AXES}
            scores = {m: matrix[m].sum(0) if m in matrix else a.input(b) for m, a in self.attributions.items()}
            extras = {m: {k: s.row(b) for k, s in a.extra_store.items()} for m, a in self.attributions.items()}
            out.append(
                Explained(
                    self.texts[b],
                    self.tokens[b],
                    target,
                    score,
                    scores,
                    t.get("probability"),
                    t.get("foil_probability"),
                    {m: e for m, e in extras.items() if e},
                    t.get("answer"),
                    matrix if "answer" in t else {},
                    t.get("phrase"),
                    None if self.segments is None else self.segments[b],
                )
            )
        return out

    def to_json(self) -> dict[str, Any]:
        """The analysis JSON (`Analysis.to_json`, each input's 'target' included) plus each input's 'scores'
        (method → one number per token), the short form `explain` has always written."""
        doc = super().to_json()
        for b, inp in enumerate(doc["inputs"]):
            inp["scores"] = {  # an answer's: the answer-level scores (its matrix summed over the answer)
                m: [float(v) for v in (a.input(b).sum(0) if a.dims == ANSWER_AXES else a.input(b))]
                for m, a in self.attributions.items()
            }
        if self.segments is not None:  # segment scores of the token scores above (an answer's: answer-level)
            for b, (inp, segs) in enumerate(zip(doc["inputs"], self.segments, strict=True)):
                scores = {m: np.asarray(v) for m, v in inp["scores"].items()}
                inp["segments"] = segmented.to_json(segs, len(self.tokens[b])) | segmented.scores_json(segs, scores)
        return doc

    def dumps(self) -> str:
        """The explanation as a JSON string (`to_json`)."""
        return json.dumps(self.to_json())

    def html(self) -> str:
        """A self-contained HTML page of the explanation."""
        return str(views.view("explanation.page")(self))

    def _repr_html_(self) -> str:
        return str(views.view("explanation.notebook")(self))

    def show(self, console: Any = None) -> None:
        """Print the explanation in the terminal (rich): each input's tokens with their scores per method."""
        views.view("explanation.show")(self, console)
