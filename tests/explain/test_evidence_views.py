"""`evaluate --task blimp`'s JSON and figure (issue 45, item 10): a split without prompts (a paradigm the model never
gets wrong) is n = 0 with null metrics, not "N numbers are not finite"; with removal the figure shows the alignment
with the evidence it exists for, beside the AOPC, not deletion curves."""

from __future__ import annotations

import json

import pytest
from matplotlib.figure import Figure

from mixlens.explain import evidence
from mixlens.explain.evaluate import Evaluation, evaluate
from mixlens.viz import evaluation as figures
from tests.conftest import random_lens
from tests.explain.test_evidence import _write


@pytest.fixture(scope="module")
def blimp(tokenizer, tmp_path_factory):
    causal = random_lens("gpt2", tokenizer, head="AutoModelForCausalLM")
    rows = evidence.read_rows(_write(tmp_path_factory.mktemp("blimp") / "toy.csv"))
    texts, cs, skipped = evidence.prepare(tokenizer, rows)
    return evaluate(causal, texts, ["logit_attn"], contrasts=cs, task="blimp", skipped=skipped, batch_size=2)


def test_an_empty_split_is_n_0_not_non_finite(blimp):
    doc = json.loads(blimp.dumps())
    for e in doc["examples"]:  # every prediction right: the 'wrong' split has no prompt
        e["f"] = abs(e["f"]) + 1.0
    right = json.loads(Evaluation.from_json(doc).dumps())
    assert right["task_metrics"]["toy"]["wrong"] == {"n": 0, "logit_attn": None, "random": None}
    assert right["task_metrics"]["toy"]["correct"]["n"] == 3
    assert not any("not finite" in n for n in right["notes"]), right["notes"]


def test_the_figure_shows_the_alignment(blimp, tmp_path, monkeypatch):
    drawn: list[list[str]] = []
    save = Figure.savefig

    def spy(fig, *args, **kwargs):
        drawn.append([ax.get_xlabel() for ax in fig.axes])
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    assert blimp.removal == "delete"
    figures.plot(blimp, tmp_path / "e.png")
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"
    labels = drawn[0]
    assert labels[0].startswith("MRR with the evidence, 3 prompts") and labels[1].startswith("AOPC of the logit")
    assert not any("top-K" in label for label in labels)  # no deletion curves
