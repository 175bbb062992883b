"""The custom-task example of docs/guides/bertology.md runs with `sweep` and scores what it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mixlens.bertology.sweep import sweep
from mixlens.interventions import Ablation, merged_edits
from mixlens.trace import hooked
from tests.conftest import random_lens

DOC = Path(__file__).resolve().parents[2] / "docs" / "guides" / "bertology.md"
PAIRS = [
    ("A man is playing a guitar.", "A man plays the guitar."),
    ("A woman is slicing an onion.", "Someone is cutting an onion."),
    ("Two dogs run in the park.", "Dogs are running outside."),
    ("Kids play soccer.", "Children are playing football on a field."),
]


def _example_task_class() -> type:
    block = re.search(r"<!-- task-example -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert block, "the task example block is missing from docs/guides/bertology.md"
    namespace: dict = {}
    exec(block.group(1), namespace)
    return namespace["ParaphraseMargin"]


def _margin(lens, edits=None) -> float:
    """The example's metric by hand: each sentence embedded alone (no padding), the model called directly."""
    embs = []
    with torch.no_grad():
        for s in [s for p in PAIRS for s in p]:
            inputs = lens.encode([s]).inputs
            with hooked(lens.adapter, edits(inputs) if edits else None):
                embs.append(lens.model(**inputs).last_hidden_state[0].mean(0))
    e = torch.nn.functional.normalize(torch.stack(embs), dim=-1)
    cos = e[0::2] @ e[1::2].T
    return float(
        torch.mean(
            torch.stack([cos[i, i] - max(cos[i, j] for j in range(len(PAIRS)) if j != i) for i in range(len(PAIRS))])
        )
    )


def test_documented_task_example(tokenizer):
    lens = random_lens("bert", tokenizer)
    task = _example_task_class()(lens, PAIRS, batch_size=3)
    res = sweep(lens, task, "zero")
    assert res.metric == "margin" and res.heads.shape == (2, 4) and res.n_examples == len(PAIRS)
    assert res.baseline == pytest.approx(_margin(lens), abs=1e-5)
    ablation = [Ablation(1, (2,), "zero")]
    want = _margin(lens, lambda inputs: merged_edits(lens, ablation, inputs["attention_mask"].bool()))
    assert res.heads[1, 2] == pytest.approx(want, abs=1e-5) and res.heads[1, 2] != res.baseline
