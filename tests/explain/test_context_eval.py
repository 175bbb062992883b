"""`mixlens evaluate --task context` (`mixlens.explain.context`): the answer's tokens, the scores per passage, the
gold passage's rank, leave-one-passage-out by hand, resume and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mixlens.errors import MixlensError
from mixlens.explain import context as C
from tests.conftest import random_lens, run_cli
from tests.explain.test_context_task import task

HEADER, SEP = task.HEADER, task.SEPARATOR


@pytest.fixture(scope="module")
def causal(tokenizer):
    return random_lens("llama", tokenizer, head="AutoModelForCausalLM")


def greedy(lens, ids: list[int], k: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(k):
            logits = lens.model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def answered_rows(lens, count: int, answer_tokens: int = 2) -> list[dict]:
    """Generator rows whose answer is replaced by the random model's own greedy continuation (so that it answers
    them correctly), kept where that continuation is " " + a text that tokenizes back to the same tokens."""
    tok = lens.tokenizer
    rows = []
    for r in task.generate(40, 3, 90, seed=5):
        ids, lead = C.prompt_tokens(tok, r["prompt"])
        cont = greedy(lens, ids, answer_tokens)
        answer = tok.decode(cont).strip()
        full = tok(r["prompt"] + " " + answer, add_special_tokens=False)["input_ids"]
        if answer and not any(t in tok.all_special_ids for t in cont) and full == ids[lead:] + cont:
            rows.append({**r, "answer": answer})
        if len(rows) == count:
            return rows
    pytest.skip("the random model's greedy continuations do not round-trip")


def write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


# ------------------------------------------------------------------------------------------------ ranks, metrics


def test_gold_rank_ties_and_nan():
    assert C.gold_rank(np.array([0.1, 0.5, 0.3]), 1) == 1
    assert C.gold_rank(np.array([0.1, 0.5, 0.3]), 0) == 3
    assert C.gold_rank(np.array([0.3, 0.3, 0.3]), 2) == 3  # ties: earlier passage first
    assert C.gold_rank(np.array([0.3, 0.3, 0.3]), 0) == 1
    assert C.gold_rank(np.array([np.nan, 0.0, -1.0]), 0) == 3  # nan ranks last


def test_expected_random_is_the_mean_over_all_permutations():
    import itertools

    for n in (2, 3, 5):
        rr = [1.0 / (perm.index(0) + 1) for perm in itertools.permutations(range(n))]
        mrr, top1 = C.expected_random(n)
        assert mrr == pytest.approx(np.mean(rr)) and top1 == pytest.approx(1 / n)
    assert C.expected_random(4)[0] == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)


def test_mrr_and_top1_on_hand_made_ranks():
    def ex(scores, gold, correct=True):
        return C.Example(
            0,
            "t",
            "a",
            [1],
            gold,
            len(scores),
            10,
            [0.0],
            correct,
            {"m": np.array([scores])},
            np.array(scores),
            np.array(scores),
            {"m": 2.0},
        )

    # gold ranks 1, 2, 4 among 4 passages; a wrong prompt is not scored
    exs = [ex([4.0, 1, 2, 3], 0), ex([1.0, 3, 2, 0], 2), ex([9.0, 8, 7, 6], 3), ex([0.0, 0, 0, 9], 0, False)]
    ev = C.ContextEvaluation("m", "v", ["m"], exs, 0, 4, {})
    met = ev.metrics()
    assert met["m"]["n"] == 3
    assert met["m"]["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 4) / 3)
    assert met["m"]["top1"] == pytest.approx(1 / 3)
    lo, hi = met["m"]["ci95"]["mrr"]
    assert 0.25 <= lo <= met["m"]["mrr"] <= hi <= 1.0
    assert met[C.EXPECTED]["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    assert ev.counts() == {"prompts": 4, "done": 4, "answered_correctly": 3, "wrong": 1}
    back = C.ContextEvaluation.from_json(json.loads(ev.dumps()))
    assert back.metrics()["m"]["mrr"] == pytest.approx(met["m"]["mrr"])
    assert "| m | 0.58 |" in ev.table()


# ------------------------------------------------------------------------------------------------ scores, LOO


def single_token(lens, ids: list[int], target: int, methods: list[str]) -> dict[str, np.ndarray]:
    """The existing single-token explanation of `target` after `ids` (the logit, for the decompositions)."""
    from mixlens.explain import attributions as attr
    from mixlens.explain.explain import read_targets

    trace = lens.trace_for(lens.encode_ids([ids]), methods, output=True)
    _, ro, _ = read_targets(lens, trace, target, None)
    res = attr.attribute(trace, ro, methods, target=target)
    return {m: res[m][0].numpy() for m in methods}


def test_answer_rows_equal_the_token_by_token_explanation(causal):
    (r,) = answered_rows(causal, 1, answer_tokens=3)
    p = C._check_line(r, "row", 1)
    tok = C.tokenize(causal.tokenizer, p)
    assert len(tok.answer) == 3
    methods = ["logit_attn", "alti_logit", "grad_x_input"]
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}
    one = C.token_scores(causal, tok.prompt, tok.answer, methods, timings=timings, cpu=cpu)
    assert set(timings) == set(cpu) == set(methods) and all(v > 0 for v in cpu.values())
    n = len(tok.prompt)
    for a, t in enumerate(tok.answer):  # row a: answer[a] explained after prompt + answer[:a] (teacher forcing)
        ref = single_token(causal, tok.prompt + tok.answer[:a], t, methods[:2])
        for m in methods[:2]:
            np.testing.assert_allclose(one[m][a, : n + a], ref[m], rtol=1e-4, atol=1e-5)
    for m in methods:
        assert one[m].shape == (3, n + 3)
        for a in range(3):  # answer token a sees the prompt and the answer's first a tokens
            assert not one[m][a, n + a :].any()
    # answer_token_scores takes the texts
    by_text = C.answer_token_scores(causal, p.prompt, p.continuation, ["logit_attn"])
    np.testing.assert_allclose(by_text["logit_attn"], one["logit_attn"], atol=1e-6)
    with pytest.raises(MixlensError, match="not a continuation"):
        C.answer_token_scores(causal, p.prompt, "\u200b", ["logit_attn"])
    # passage scores are the exact sums of their tokens' scores; the rest is outside the passages
    per = C.passage_scores(tok, one["logit_attn"])
    outside = tok.segments.outside_score(np.pad(one["logit_attn"][:, :n], ((0, 0), (0, 1))))
    np.testing.assert_allclose(per.sum(1) + outside, one["logit_attn"][:, :n].sum(1), atol=1e-9)
    for j, s in enumerate(tok.segments.segments):
        a, b = p.passages[j]
        assert p.prompt[a:b].startswith(f"Passage {j + 1}:") and s.end > s.start


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])  # gemma 3: a sliding window of 4 in the cache
def test_leave_one_out_equals_n_plus_one_forward_passes_by_hand(family, tokenizer):
    causal = random_lens(family, tokenizer, head="AutoModelForCausalLM")
    r = task.generate(1, 4, 120, seed=2)[0]
    p = C._check_line(r, "row", 1)
    tok = C.tokenize(causal.tokenizer, p)
    passages = [p.prompt[a:b] for a, b in p.passages]
    tail = p.prompt[p.passages[-1][1] :]

    def logprob(prompt: str) -> float:  # eager attention, every position's logits
        ids = causal.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        lead = [causal.tokenizer.cls_token_id] if causal.tokenizer.cls_token_id is not None else []
        x = torch.tensor([lead + ids + tok.answer[:-1]])
        with torch.no_grad():
            lp = causal.model(input_ids=x).logits[0].double().log_softmax(-1)
        n = len(lead) + len(ids)
        return float(sum(lp[n - 1 + a, t] for a, t in enumerate(tok.answer)))

    base = logprob(p.prompt)
    want = [base - logprob(HEADER + SEP.join(passages[:k] + passages[k + 1 :]) + tail) for k in range(len(passages))]
    got = C.leave_one_out(causal, p, tok, float(C.answer_logprobs(causal, tok.prompt, tok.answer)[0].sum()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert C.without_passage("A\n\nB\n\nC", (3, 4)) == "A\n\nC" and C.without_passage("A\n\nB", (3, 4)) == "A\n\n"


# ------------------------------------------------------------------------------------------------ the CLI


@pytest.fixture(scope="module")
def model_dir(causal, tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    causal.model.save_pretrained(d)
    causal.tokenizer.save_pretrained(d)
    return d


def test_cli_end_to_end_resume_and_refusals(causal, model_dir, tmp_path, capsys, monkeypatch):
    rows = answered_rows(causal, 3)
    wrong = {**rows[0], "answer": "zebra"}  # not the model's answer: counted, not scored
    data = tmp_path / "ctx.jsonl"
    write(data, [*rows, wrong])
    out = tmp_path / "out"
    args = [
        "evaluate",
        "--task",
        "context",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "-o",
        str(out),
        "--method",
        "logit_attn",
        "--method",
        "grad_x_input",
    ]
    rc, stdout, err = run_cli([*args, "-f", "json"], capsys)
    assert rc == 0, err
    doc = json.loads(stdout)
    assert doc == json.loads((out / "evaluation.json").read_text())
    assert doc["counts"] == {"prompts": 4, "done": 4, "answered_correctly": 3, "wrong": 1}
    assert [e["correct"] for e in doc["examples"]] == [True, True, True, False]
    assert doc["examples"][3]["passage_scores"] == {} and doc["examples"][3]["leave_one_out"] is None
    for m in ("logit_attn", "grad_x_input", C.LOO, C.RANDOM):
        ranks = [C.gold_rank(np.array(C.Example.from_json(e).ranked(m)), e["gold"]) for e in doc["examples"][:3]]
        assert [e["ranks"][m] for e in doc["examples"][:3]] == ranks
        assert doc["metrics"][m]["mrr"] == pytest.approx(np.mean([1 / k for k in ranks]))
        assert doc["metrics"][m]["n"] == 3
    # the passage scores are the method's token scores summed per passage and answer token
    lens_scores = C.token_scores(causal, *_ids(causal, rows[1]), ["logit_attn"])["logit_attn"]
    tok = C.tokenize(causal.tokenizer, C._check_line(rows[1], "row", 1))
    np.testing.assert_allclose(
        doc["examples"][1]["passage_scores"]["logit_attn"], C.passage_scores(tok, lens_scores), atol=1e-5
    )
    # the table
    rc, stdout, err = run_cli(args, capsys)  # a finished run of the same data: run again, replaced
    assert rc == 0 and "| leave_one_out |" in stdout and "3 of 4 prompts answered correctly" in stdout

    # interrupted after the first prompt, then resumed: the same result as in one run
    out2 = tmp_path / "out2"
    calls = {"n": 0}
    real = C.leave_one_out

    def stop(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(C, "leave_one_out", stop)
    args2 = [*args[:-6], "-o", str(out2), *args[-4:]]
    rc, _, err = run_cli(args2, capsys)
    assert rc == 130 and "Resume with the same command" in err
    part = json.loads((out2 / "evaluation.json").read_text())
    assert part["interrupted"] == {"examples": 1, "of": 4}
    monkeypatch.setattr(C, "leave_one_out", real)
    rc, _, err = run_cli([*args2, "-f", "json"], capsys)
    assert rc == 0 and "resuming the interrupted evaluation" in err
    again = json.loads((out2 / "evaluation.json").read_text())
    for a, b in zip(again["examples"], doc["examples"], strict=True):
        assert a["ranks"] == b["ranks"] and a["random"] == b["random"]
        np.testing.assert_allclose(a["leave_one_out"] or [], b["leave_one_out"] or [], atol=1e-6)

    # another data file into a folder holding a finished run: refused
    other = tmp_path / "other.jsonl"
    write(other, rows[:1])
    rc, _, err = run_cli([*args[:5], "--data", str(other), "-o", str(out)], capsys)
    assert rc == 2 and "other data" in err and len(err.strip().splitlines()) == 1


def test_removal_none_leaves_leave_one_out_out(causal, model_dir, tmp_path, capsys, monkeypatch):
    """`--removal none`: no leave-one-out forward pass, no leave_one_out row or rank; the methods' scores are those
    of a run with it, and the run is another one (a run with leave-one-out in that folder is not resumed)."""
    rows = answered_rows(causal, 2)
    data = tmp_path / "ctx.jsonl"
    write(data, rows)
    out = tmp_path / "out"
    args = ["evaluate", "--task", "context", "--model", str(model_dir), "--data", str(data), "-o", str(out)]
    args += ["--method", "logit_attn"]
    with_loo = tmp_path / "with"
    rc, stdout, err = run_cli([*args[:-4], "-o", str(with_loo), *args[-2:], "-f", "json"], capsys)
    assert rc == 0, err
    full = json.loads(stdout)
    monkeypatch.setattr(C, "leave_one_out", lambda *a, **k: pytest.fail("leave-one-out ran"))
    rc, stdout, err = run_cli([*args, "--removal", "none", "-f", "json"], capsys)
    assert rc == 0, err
    doc = json.loads(stdout)
    assert doc["run"]["leave_one_out"] is False and "leave_one_out" not in full["run"]
    assert set(doc["metrics"]) == {"logit_attn", C.RANDOM, C.EXPECTED}
    for a, b in zip(doc["examples"], full["examples"], strict=True):
        assert a["leave_one_out"] is None and C.LOO not in a["ranks"] and C.LOO not in a["seconds"]
        assert a["ranks"] == {k: v for k, v in b["ranks"].items() if k != C.LOO}
        np.testing.assert_allclose(a["passage_scores"]["logit_attn"], b["passage_scores"]["logit_attn"], atol=1e-6)
    rc, stdout, err = run_cli([*args, "--removal", "none"], capsys)  # the table: no leave-one-out row
    assert rc == 0 and "| logit_attn |" in stdout and "leave_one_out" not in stdout
    rc, _, err = run_cli([*args[:-4], "-o", str(with_loo), *args[-2:], "--removal", "none"], capsys)
    assert rc == 2 and "other data" in err and len(err.strip().splitlines()) == 1


def _ids(lens, row):
    tok = C.tokenize(lens.tokenizer, C._check_line(row, "row", 1))
    return tok.prompt, tok.answer


BASE = {
    "prompt": "Passage 1: a b.\n\nPassage 2: c d.\n\nQuestion: x\nAnswer: y",
    "answer": "d",
    "gold": 1,
    "passages": [[0, 15], [17, 32]],
}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({k: v for k, v in BASE.items() if k != "gold"}, "no field gold"),
        ({**BASE, "passages": [[0, 15], [17, 999]]}, "outside the prompt"),
        ({**BASE, "passages": [[0, 20], [17, 32]]}, "overlaps"),
        ({**BASE, "gold": 2}, "not a passage index from 0 to 1"),
        ({**BASE, "gold": True}, "not a passage index"),
        ({**BASE, "answer": " d"}, "without surrounding whitespace"),
        ({**BASE, "passages": [[0, 15]]}, "at least 2"),
        ({**BASE, "answer": "\u200b"}, "not a continuation of the prompt"),
        ("[1, 2]", "not a JSON object"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_input_is_one_line_exit_2(line, message, model_dir, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    good = json.dumps(BASE)
    bad = line if isinstance(line, str) else json.dumps(line)
    data.write_text(good + "\n" + bad + "\n", encoding="utf-8")
    rc, _, err = run_cli(
        ["evaluate", "--task", "context", "--model", str(model_dir), "--data", str(data), "-o", str(tmp_path / "o")],
        capsys,
    )
    assert rc == 2, err
    assert message in err and "line 2" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_options_of_other_tasks_are_refused(model_dir, tmp_path, capsys):
    data = tmp_path / "ok.jsonl"
    data.write_text(json.dumps(BASE) + "\n", encoding="utf-8")
    for extra in (["--removal", "mask"], ["--text-column", "x"]):
        rc, _, err = run_cli(["evaluate", "--task", "context", "--data", str(data), *extra], capsys)
        assert rc == 2 and "--task context" in err


def test_read_prompts_skip_limit_and_empty(tmp_path):
    data = tmp_path / "d.jsonl"
    write(data, [{**BASE, "id": k} for k in range(5)])
    assert [p.id for p in C.read_prompts(data, skip=1, limit=2)] == [1, 2]
    with pytest.raises(MixlensError, match="no prompts"):
        C.read_prompts(data, skip=5)
