"""Checkpointing of `evaluate`: the examples finished so far survive a Ctrl-C (`Interrupted`) or a kill (a save
every `CHECKPOINT_EVERY` seconds), and a later run resumes after them only when it is the same run."""

from __future__ import annotations

from collections.abc import Sequence

from mixlens.errors import MixlensError
from mixlens.explain.evaluation import Evaluation

CHECKPOINT_EVERY = 60.0  # seconds between saves of the finished examples (a run killed without warning resumes)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `evaluate`: `partial` holds the Evaluations of the examples finished before it (per removal;
    empty when none finished)."""

    def __init__(self, partial: dict[str, Evaluation], total: int) -> None:
        super().__init__()
        self.partial = partial
        self.total = total


def resumed(
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
