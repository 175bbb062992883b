"""The context-attribution task's generator (scripts/context_task.py): seeded, one gold passage, right spans."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "context_task.py"
spec = importlib.util.spec_from_file_location("context_task", SCRIPT)
assert spec is not None and spec.loader is not None
task = importlib.util.module_from_spec(spec)
sys.modules.setdefault("context_task", task)  # dataclasses look their module up
spec.loader.exec_module(task)


def test_same_seed_same_prompts_other_seed_others():
    a = task.generate(20, 6, 600, seed=3)
    assert a == task.generate(20, 6, 600, seed=3)
    assert [r["prompt"] for r in a] != [r["prompt"] for r in task.generate(20, 6, 600, seed=4)]


@pytest.mark.parametrize(("n", "tokens"), [(2, 64), (5, 1024), (10, 1024), (24, 4096)])
def test_the_answer_is_in_exactly_the_gold_passage_and_spans_are_right(n, tokens):
    rows = task.generate(30, n, tokens, seed=0)
    assert {r["gold"] for r in rows} != {rows[0]["gold"]}  # the gold passage moves
    for r in rows:
        prompt, spans = r["prompt"], r["passages"]
        assert len(spans) == r["n_passages"] == n and 0 <= r["gold"] < n
        passages = [prompt[a:b] for a, b in spans]
        for k, p in enumerate(passages):
            assert p.startswith(f"Passage {k + 1}: ") and p == p.strip() and "\n" not in p
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False))  # disjoint, in order
        # the answer's text: in the gold passage once, nowhere else in the prompt
        assert len(re.findall(re.escape(r["answer"]), prompt)) == 1
        assert passages[r["gold"]].count(r["answer"]) == 1
        tail = prompt[spans[-1][1] :]  # after the last passage: the question and the answer's start
        assert tail.startswith(f"\n\nQuestion: {r['question']}\nAnswer: ") and not tail.endswith(" ")
    lengths = [task.estimate(r["prompt"]) for r in rows]
    assert min(lengths) >= 0.8 * tokens or tokens < 100  # about the requested length (estimated tokens)
    assert max(lengths) <= 1.5 * tokens + 100


def test_distractors_state_the_same_kind_of_fact():
    for r in task.generate(10, 8, 800, seed=1):
        kind = next(k for k in task.KINDS if k.name == r["kind"])
        lead = kind.statement.split("{")[0] or " lives in the town of "
        assert sum(lead in r["prompt"][a:b] for a, b in r["passages"]) >= 2


def test_tokenizer_counts_the_length(tokenizer):
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    (r,) = task.generate(1, 4, 400, seed=0, count=count)
    n = count(r["prompt"])
    assert 400 <= n <= 560


def test_cli_writes_jsonl(tmp_path):
    out = tmp_path / "ctx.jsonl"
    task.main(["--out", str(out), "--prompts", "3", "--passages", "4", "--tokens", "256", "--seed", "7"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == task.generate(3, 4, 256, seed=7)
    with pytest.raises(SystemExit):
        task.main(["--out", str(out), "--passages", "1"])
