"""`mixlens evaluate --task blimp`: contrastive targets with evidence (mixlens.explain.evidence)."""

from __future__ import annotations

import csv
import itertools
import json
import math

import numpy as np
import pytest
import torch

from mixlens.explain import evidence
from mixlens.explain.evaluate import Evaluation, evaluate
from mixlens.viz.terminal import evidence_table
from tests.conftest import DATA, random_lens, run_cli

HEADER = [
    "",
    "sentence_good",
    "sentence_bad",
    "one_prefix_prefix",
    "one_prefix_word_good",
    "one_prefix_word_bad",
    "target",
    "target_phrase",
]
ROWS = [  # prompt, good, bad, target, target_phrase
    ("Raymond is selling this", "sketch", "sketches", "this", "this"),
    ("Those radii of these", "have", "has", "these", "these"),  # 'these' not matched inside 'Those'
    ("Karla could listen to", "herself", "himself", "NA", "NA"),  # NA: skipped
    ("Craig explored that", "grocery store", "grocery stores", "that", "that"),  # same first token: skipped
    ("Eva has scared the", "children", "child", "those", "those"),  # evidence not in the prompt: skipped
    ("Some waiters broke this lost", "foot", "feet", "this", "this"),
]


def _write(path, rows=ROWS):
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(HEADER)
        for k, (p, g, b, t, tp) in enumerate(rows):
            w.writerow([k, f"{p} {g}.", f"{p} {b}.", p, g, b, t, tp])
    return path


@pytest.fixture(scope="module")
def causal(tokenizer):
    return random_lens("gpt2", tokenizer, head="AutoModelForCausalLM")


def test_reciprocal_rank_by_hand():
    special = np.array([True, False, False, False, False])
    s = np.array([9.0, 0.5, 0.5, 0.2, 0.1])  # the special token's 9 never counts
    assert evidence.reciprocal_rank(s, special, [2]) == 0.5  # tie with position 1: earlier first → rank 2
    assert evidence.reciprocal_rank(s, special, [1]) == 1.0
    assert evidence.reciprocal_rank(s, special, [4, 3]) == pytest.approx(1 / 3)  # the best-ranked evidence token
    assert math.isnan(evidence.reciprocal_rank(s, special, [0]))  # only a special position
    nan = np.array([0.0, np.nan, 0.3, 0.2, 0.1])
    assert evidence.reciprocal_rank(nan, special, [1]) == 0.25  # a NaN score ranks last


def test_rows_are_prepared_and_skips_counted(tokenizer, tmp_path):
    rows = evidence.read_rows(_write(tmp_path / "toy.csv"))
    assert [r.phrase for r in rows][2] is None
    texts, cs, skipped = evidence.prepare(tokenizer, rows)
    assert texts == [ROWS[0][0], ROWS[1][0], ROWS[5][0]]
    assert skipped == {"toy": {evidence.SKIP_NA: 1, evidence.SKIP_SAME: 1, evidence.SKIP_NOT_FOUND: 1}}
    ids = tokenizer(texts)["input_ids"]
    toks = [tokenizer.convert_ids_to_tokens(x) for x in ids]
    assert [toks[0][p] for p in cs[0].evidence] == ["this"]
    assert [toks[1][p] for p in cs[1].evidence] == ["these"]  # the word-boundary match, not 'Those'
    assert cs[0].target == tokenizer(" sketch", add_special_tokens=False)["input_ids"][0]
    assert cs[0].foil != cs[0].target and cs[0].group == "toy"


def test_evaluation_recomputes_from_its_json(causal, tokenizer, tmp_path):
    texts, cs, skipped = evidence.prepare(tokenizer, evidence.read_rows(_write(tmp_path / "toy.csv")))
    ev = evaluate(causal, texts, ["alti_logit", "saliency"], contrasts=cs, task="blimp", skipped=skipped, batch_size=2)
    doc = json.loads(ev.dumps())
    assert doc["task"] == "blimp" and doc["skipped"] == skipped
    with torch.no_grad():
        for e in doc["examples"]:  # f = the model's logit difference target − foil at the last token
            row = causal.model(**causal.encode_ids([e["ids"]]).inputs).logits[0, -1]
            c = e["contrast"]
            assert e["f"] == pytest.approx(float(row[c["target_id"]] - row[c["foil_id"]]), abs=1e-4)
            assert e["target"]["foil"] is not None
    met = doc["task_metrics"]["toy"]
    for m in ("alti_logit", "saliency", "random"):  # MRR recomputed by hand from the JSON
        rr = [
            evidence.reciprocal_rank(np.array(e["scores"][m]), np.array(e["special"]), e["contrast"]["evidence"])
            for e in doc["examples"]
        ]
        assert met["all"][m]["mrr"] == pytest.approx(np.mean(rr))
        right = [r for r, e in zip(rr, doc["examples"], strict=True) if e["f"] > 0]
        if right:
            assert met["correct"][m]["mrr"] == pytest.approx(np.mean(right))
    assert met["accuracy"] == pytest.approx(np.mean([e["f"] > 0 for e in doc["examples"]]))
    assert met["correct"]["n"] + met["wrong"]["n"] == met["n"] == 3
    again = Evaluation.from_json(doc)
    assert json.loads(again.dumps())["task_metrics"]["toy"]["all"] == met["all"]
    assert max(len(line) for line in evidence_table(ev).splitlines()) <= 100


def test_removal_none_runs_no_perturbed_pass_and_keeps_the_alignment(causal, tokenizer, tmp_path, monkeypatch):
    from mixlens.explain import scoring as scoring_module
    from mixlens.viz.evaluation import plot

    texts, cs, skipped = evidence.prepare(tokenizer, evidence.read_rows(_write(tmp_path / "toy.csv")))
    full = evaluate(causal, texts, ["logit_attn"], contrasts=cs, task="blimp", skipped=skipped, batch_size=2)

    def no_forward(*args, **kwargs):
        raise AssertionError("removal none ran a perturbed forward pass")

    monkeypatch.setattr(scoring_module, "forward_f", no_forward)
    ev = evaluate(
        causal, texts, ["logit_attn"], contrasts=cs, task="blimp", skipped=skipped, batch_size=2, removal="none"
    )
    doc, ref = json.loads(ev.dumps()), json.loads(full.dumps())
    for m in ("logit_attn", "random"):  # the same scores, so the same alignment; no removal metric
        assert doc["task_metrics"]["toy"]["all"][m]["mrr"] == ref["task_metrics"]["toy"]["all"][m]["mrr"]
        assert doc["metrics"][m]["aopc"] is None and doc["metrics"][m]["spearman_gxi"] is not None
        assert doc["metrics"][m]["spearman_gxi"] == pytest.approx(ref["metrics"][m]["spearman_gxi"])
    assert all(e["f_removed"] == {} and e["f_kept"] == {} for e in doc["examples"])
    assert [n for n in doc["notes"] if n.startswith("removal none")] and not any(
        "not finite" in n for n in doc["notes"]
    )
    again = Evaluation.from_json(doc)
    assert json.loads(again.dumps())["task_metrics"] == doc["task_metrics"]
    assert "  -  " in evidence_table(ev)  # the removal metrics shown as not computed
    plot(ev, tmp_path / "none.png")
    assert (tmp_path / "none.png").stat().st_size > 1000


def test_cli_task_blimp(causal, tmp_path, capsys):
    model_dir = tmp_path / "model"
    causal.model.save_pretrained(model_dir)
    causal.tokenizer.save_pretrained(model_dir)
    folder = tmp_path / "data"
    folder.mkdir()
    _write(folder / "a_toy.csv")
    _write(folder / "b_toy.csv", ROWS[:2])
    out = tmp_path / "ev"
    rc, stdout, err = run_cli(
        [
            "evaluate",
            "--task",
            "blimp",
            "--model",
            str(model_dir),
            "--data",
            str(folder),
            "--method",
            "logit_attn",
            "--limit",
            "5",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert rc == 0, err
    assert "MRR" in stdout and "a_toy" in stdout and "all paradigms" in stdout
    assert max(len(line) for line in stdout.splitlines()) <= 100, [x for x in stdout.splitlines() if len(x) > 100]
    doc = json.loads((out / "evaluation.json").read_text())
    assert {e["contrast"]["group"] for e in doc["examples"]} == {"a_toy", "b_toy"}
    assert len(doc["examples"]) == 2 + 2  # --limit 5 per file: rows 0, 1 kept; 2, 3, 4 skipped in a_toy
    rc, stdout, err = run_cli(
        ["evaluate", "--task", "blimp", "--model", str(model_dir), "--data", str(folder), "--method", "logit_attn"]
        + ["--limit", "5", "--removal", "none", "--out", str(tmp_path / "none")],
        capsys,
    )
    assert rc == 0, err
    assert "(blimp, none)" in stdout and "removal none" in stdout and (tmp_path / "none" / "evaluation.png").exists()
    rc, _, err = run_cli(["evaluate", "--task", "nope", "--model", str(model_dir), "--data", str(folder)], capsys)
    assert rc == 2 and "unknown task" in err
    bad = tmp_path / "bad.csv"
    bad.write_text("text\nhello\n")
    rc, _, err = run_cli(["evaluate", "--task", "blimp", "--model", str(model_dir), "--data", str(bad)], capsys)
    assert rc == 2 and "one_prefix_prefix" in err


def test_the_real_files(causal, tokenizer):
    folder = DATA / "blimp_targets"
    if not folder.is_dir():
        pytest.skip(f"shared data folder {folder} not present")
    rows = evidence.read_rows(folder, limit=4)
    assert len({r.group for r in rows}) == 12
    texts, cs, skipped = evidence.prepare(tokenizer, rows)
    assert len(texts) + sum(sum(s.values()) for s in skipped.values()) == len(rows)
    ev = evaluate(causal, texts[:16], ["logit_attn"], contrasts=cs[:16], task="blimp", skipped=skipped)
    met = json.loads(ev.dumps())["task_metrics"]
    assert met[evidence.ALL]["n"] == 16 and 0 < met[evidence.ALL]["all"]["random"]["mrr"] <= 1


# ------------------------------------------------------------------ #45 items 16 and 23: the task file, row by row


def _header_line() -> bytes:
    return (",".join(HEADER) + "\n").encode()


@pytest.mark.parametrize(
    "content, message",
    [
        (_header_line() + b"0,a,b,Raymond is selling th\xefs,sketch,sketches,this,this\n", "line 2 is not valid UTF-8"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10", "not valid UTF-8"),
        (b"\x00\x01\x02\x03" * 10, "not a text file"),
        (_header_line() + b"0,a,b," + b"x" * 140_000 + b",sketch,sketches,this,this\n", "longer than"),
        (_header_line() + b"0,a,b,Raymond is selling this,sketch\n", "line 2 has 5 fields"),
    ],
)
def test_a_bad_task_file_is_one_line(content, message, tmp_path, capsys, monkeypatch):
    """#45 item 16: a non-UTF-8 byte, a binary file, a field over 131,072 characters or a short row gave
    tracebacks (exit 1); now one line naming the file (and line), exit 2, before the model loads."""
    import mixlens.lens

    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    with pytest.raises(evidence.MixlensError, match=message):
        evidence.read_rows(path)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mixlens.lens, "load", no_load)
    code, _, err = run_cli(["evaluate", "--task", "blimp", "--data", str(path), "-o", str(tmp_path / "o")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message.split()[0] in err and "bad.csv" in err, err


def test_a_utf8_bom_is_read(tmp_path, tokenizer):
    """#45 item 16: a file saved with a byte-order mark (Excel) was refused as missing its first column."""
    plain = tmp_path / "toy.csv"
    with plain.open("w", newline="") as fh:  # the prompt column first: the mark sticks to its name
        w = csv.writer(fh)
        w.writerow(HEADER[3:])
        w.writerows([p, g, b, t, tp] for p, g, b, t, tp in ROWS)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert [r.prompt for r in evidence.read_rows(bom)] == [r.prompt for r in evidence.read_rows(plain)]


def test_an_empty_word_is_refused_naming_its_row(tokenizer, tmp_path):
    """#45 item 23: an empty good/bad word became the lone-space token and was scored; it is a broken row, refused
    in one line naming the file and line (before the model loads: `check_rows` reads every row)."""
    for k, row in enumerate((("Raymond is selling this", "", "sketches"), ("Raymond is selling this", "sketch", " "))):
        f = _write(tmp_path / f"toy{k}.csv", [*ROWS[:2], (*row, "this", "this")])
        word = ("one_prefix_word_good", "one_prefix_word_bad")[k]
        with pytest.raises(evidence.MixlensError, match=rf"toy{k}.csv: line 4: {word} \(the (target|foil) word\)"):
            evidence.check_rows(f)
        assert len(evidence.read_rows(f, limit=2)) == 2  # rows before it are read


def test_overlong_prompts_are_skipped_and_counted(tokenizer, tmp_path):
    """#45 item 23: a prompt over the position limit was cut from the end and still scored; it is skipped and
    counted."""
    rows = [*ROWS[:2], ("Raymond is selling " + "really " * 30 + "this", "sketch", "sketches", "this", "this")]
    texts, cs, skipped = evidence.prepare(tokenizer, evidence.read_rows(_write(tmp_path / "toy.csv", rows)), 20)
    assert texts == [ROWS[0][0], ROWS[1][0]]
    assert skipped == {"toy": {evidence.SKIP_LONG: 1}}
    assert evidence.skip_line(skipped) == "1 rows left out: prompt over the model's position limit (1)"


def test_prompts_are_tokenised_in_chunks(tokenizer, tmp_path, monkeypatch):
    """#45 item 23: the whole file was tokenised at once (a million rows: 3.5 GB before the first example); the
    rows stream through in chunks of `evidence.CHUNK`."""
    monkeypatch.setattr(evidence, "CHUNK", 2)
    sizes = []

    class Counting:
        is_fast = True

        def __call__(self, texts, **kw):
            if isinstance(texts, list):
                sizes.append(len(texts))
            return tokenizer(texts, **kw)

    rows = evidence.iter_rows(_write(tmp_path / "toy.csv", ROWS * 3))
    texts, cs, skipped = evidence.prepare(Counting(), rows)
    assert max(sizes) == 2 and sum(sizes) == len(ROWS) * 3
    assert texts == [ROWS[k][0] for k in (0, 1, 5)] * 3


def _endless(drawn: list[int], n: int = 1_000_000):
    """A million rows of ROWS, made one at a time as they are read (`drawn[0]`: how many so far)."""
    for k in range(n):
        drawn[0] += 1
        p, g, b, t, tp = ROWS[k % len(ROWS)]
        yield evidence.Row("toy", p, g, b, None if tp == "NA" else tp)


def test_the_rows_stream_lazily(tokenizer, monkeypatch):
    """#45 item 23: the whole file was read and tokenised before the first example (a million rows: 3.5 GB). The
    first pair comes after one chunk of rows; the rows left out are counted as they are met."""
    monkeypatch.setattr(evidence, "CHUNK", 6)
    drawn, skipped = [0], {}
    pairs = evidence.stream(tokenizer, _endless(drawn), None, skipped)
    assert drawn == [0]  # nothing read before the first pair is asked for
    assert next(pairs)[0] == ROWS[0][0] and drawn == [6]
    assert [next(pairs)[0] for _ in range(2)] == [ROWS[1][0], ROWS[5][0]] and drawn == [6]
    assert skipped == {"toy": {evidence.SKIP_NA: 1, evidence.SKIP_SAME: 1, evidence.SKIP_NOT_FOUND: 1}}
    next(pairs)
    assert drawn == [12]


def test_long_prompts_make_smaller_chunks(tokenizer, monkeypatch):
    monkeypatch.setattr(evidence, "CHUNK_CHARS", 40)  # ROWS' prompts have 18 to 28 characters: 2 reach 40
    sizes = [len(c) for c in evidence._chunks(evidence.Row("g", p, w, w, p) for p, w, *_ in ROWS)]
    assert sizes == [2, 2, 2]


def test_evaluate_draws_one_batch_at_a_time(causal, tokenizer, monkeypatch):
    """evaluate over a streamed task file reads the rows only as batches need them: after its first batch of 2, a
    million-row source has given one chunk; an interrupt then keeps that batch."""
    from mixlens.explain.evaluate import Interrupted

    monkeypatch.setattr(evidence, "CHUNK", 6)
    drawn, skipped = [0], {}
    a, b = itertools.tee(evidence.stream(tokenizer, _endless(drawn), None, skipped))
    seen = []

    def stop(part):
        seen.append((drawn[0], len(part.examples), part.notes[-1]))
        raise KeyboardInterrupt

    with pytest.raises(Interrupted) as stop_info:
        evaluate(
            causal,
            (t for t, _ in a),
            ["saliency"],
            contrasts=(c for _, c in b),
            task="blimp",
            skipped=skipped,
            batch_size=2,
            removal="none",
            checkpoint=stop,
            checkpoint_every=0,
            total=1_000_000,
        )
    assert seen == [(6, 2, "interrupted after 2 of 1000000 examples; the metrics cover those")]
    part = stop_info.value.partial["none"]
    assert [e.text for e in part.examples] == [ROWS[0][0], ROWS[1][0]] and stop_info.value.total == 1_000_000


def test_a_streamed_evaluation_equals_the_listed_one(causal, tokenizer, tmp_path):
    """The same rows as a list and as a stream give the same evaluation (examples, skips, no interrupted note)."""
    f = _write(tmp_path / "toy.csv", ROWS * 2)
    texts, cs, skipped = evidence.prepare(tokenizer, evidence.read_rows(f))
    listed = evaluate(causal, texts, ["saliency"], contrasts=cs, task="blimp", skipped=skipped, batch_size=2)
    left: dict = {}
    a, b = itertools.tee(evidence.stream(tokenizer, evidence.iter_rows(f), None, left))
    streamed = evaluate(
        causal, (t for t, _ in a), ["saliency"], contrasts=(c for _, c in b), task="blimp", skipped=left, batch_size=2
    )
    assert streamed.metrics() == listed.metrics() and streamed.skipped == listed.skipped == left
    assert [e.text for e in streamed.examples] == texts and streamed.notes == listed.notes
