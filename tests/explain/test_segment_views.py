"""Segments as part of an explanation (`Explanation.segments`, `mixlens.result.segmented`) and their views
(`mixlens.viz.segments`): saved, loaded and written to JSON with the explanation, checked when read; the ranked list
and the answer tokens × segments heatmap in the terminal, in HTML and as a figure, every number an exact sum of
token scores."""

from __future__ import annotations

import copy
import io
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rich.console import Console

from mixlens.errors import MixlensError
from mixlens.explain import explain
from mixlens.explain import segments as S
from mixlens.result import Analysis, Explanation
from mixlens.result import segmented as R
from mixlens.result.segmented import Segment
from mixlens.targets import Target
from mixlens.viz import segments as V
from tests.conftest import random_lens, run_cli

TEXTS = ["The cat sat. || A dog ran far. || Birds sing.", "Rain fell. || Wind blew hard today."]
METHODS = ["decompx_logit", "grad_x_input"]


@pytest.fixture(scope="module")
def lens(tokenizer):
    return random_lens("gpt2", tokenizer, head="AutoModelForCausalLM")


@pytest.fixture(scope="module")
def expl(lens) -> Explanation:
    res = explain(lens, TEXTS, METHODS)
    res.segments = [S.passages(lens.tokenizer, t, "||").segments for t in TEXTS]
    return res


# ---- the math, on synthetic matrices ----


def random_segments(rng: np.random.Generator, n: int) -> list[Segment]:
    """Disjoint token ranges over n tokens with gaps (tokens in no segment) and an empty segment."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=6, replace=False))
    pairs = zip(cuts[::2], cuts[1::2], strict=True)
    segs = [Segment(f"s{k}", 10 * k, 10 * k + 5, int(a), int(b)) for k, (a, b) in enumerate(pairs)]
    return [*segs, Segment("empty", 100, 105, 0, 0)]


@pytest.mark.parametrize("seed", range(5))
def test_answer_segment_matrix_is_the_sum_of_each_segments_columns(seed):
    rng = np.random.default_rng(seed)
    a, n = int(rng.integers(1, 9)), int(rng.integers(12, 40))
    scores = rng.standard_normal((a, n)).astype(np.float32)
    segs = random_segments(rng, n)
    m = R.answer_segment_matrix(scores, segs)
    assert m.shape == (a, len(segs) + 1)
    out = [i for i in range(n) if not any(s.start <= i < s.end for s in segs)]
    for r in range(a):
        for j, s in enumerate(segs):
            assert m[r, j] == pytest.approx(math.fsum(float(x) for x in scores[r, s.start : s.end]), abs=1e-12)
        assert m[r, -1] == pytest.approx(math.fsum(float(scores[r, i]) for i in out), abs=1e-12)
        assert m[r].sum() == pytest.approx(math.fsum(scores[r].tolist()), abs=1e-9)  # nothing lost, nothing twice
    assert m[:, -2].tolist() == [0.0] * a  # the empty segment
    # the answer-level scores (sum over the answer) are the segment scores of the summed token scores
    np.testing.assert_allclose(m.sum(0), R.segment_scores(segs, scores.astype(np.float64).sum(0)), atol=1e-9)
    np.testing.assert_allclose(R.answer_segment_matrix(scores[0], segs), m[:1])  # [source] is one answer row


def test_views_of_a_synthetic_answer_matrix():
    segs = [Segment("1 user", 0, 5, 1, 3), Segment("2 user", 6, 9, 4, 6)]
    scores = np.array([[0.5, 1.0, 2.0, -1.0, 0.25, 0.25], [0.0, -3.0, 1.0, 0.0, 4.0, 1.0]])
    v = V.answer_segments("m", [" Par", "is"], scores, segs)
    assert v.labels == ["1 user", "2 user", R.OUTSIDE]
    np.testing.assert_array_equal(v.matrix, [[3.0, 0.5, -0.5], [-2.0, 5.0, 0.0]])
    np.testing.assert_array_equal(v.totals, [1.0, 5.5, -0.5])
    assert v.signed and not V.answer_segments("m", ["a", "b"], np.abs(scores), segs).signed
    console = Console(file=io.StringIO(), width=200, color_system="truecolor")
    console.print(V.heatmap_table(v))
    shown = console.file.getvalue()
    assert "+3" in shown and "-2" in shown and "+5" in shown and "(outside)" in shown and " Par" in shown
    markup = V.heatmap_html(v)
    assert markup.count("<tr>") == 3 and "+3</td>" in markup and "-0.5</td>" in markup and "signed" in markup
    with pytest.raises(ValueError, match="answer tokens"):
        V.answer_segments("m", ["one"], scores, segs)
    with pytest.raises(MixlensError, match="reach past"):
        R.answer_segment_matrix(scores[:, :4], segs)


# ---- a real explanation of one target (answer = 1) ----


def test_a_single_target_is_an_answer_of_one_row(expl):
    for b, e in enumerate(expl.inputs):
        assert e.segments == expl.segments[b]
        views = V.input_views(e)
        assert [v.method for v in views] == METHODS
        for v in views:
            tokens = np.asarray(e.scores[v.method], dtype=np.float64)
            assert v.answer == [e.target.label] and v.matrix.shape == (1, len(e.segments) + 1)
            for j, s in enumerate(e.segments):
                assert v.matrix[0, j] == pytest.approx(math.fsum(tokens[s.start : s.end].tolist()), abs=1e-9)
            assert v.matrix.sum() == pytest.approx(math.fsum(tokens.tolist()), abs=1e-6)


def test_decompx_segments_add_up_to_the_target_logit(lens, expl):
    for b, e in enumerate(expl.inputs):
        enc = lens.tokenizer(TEXTS[b], return_tensors="pt")
        with torch.no_grad():
            row = lens.model(**enc).logits[0, -1]
        (v,) = [x for x in V.input_views(e) if x.method == "decompx_logit"]
        # decompx_logit decomposes the target's logit over the tokens: the segments and the outside tokens add up to
        # the model's own logit (float32 forward pass)
        assert v.totals.sum() == pytest.approx(float(row[e.target.index]), abs=1e-3)
        assert len(v.totals) == len(e.segments) + 1 and np.count_nonzero(v.totals) == len(v.totals)


# ---- part of the result: JSON, save / load, concat ----


def test_segments_round_trip_through_json_and_files(expl, tmp_path):
    doc = json.loads(expl.dumps())
    seg = doc["inputs"][0]["segments"]
    assert seg["labels"] == ["passage 1", "passage 2", "passage 3"]
    assert seg["char_ranges"][0] == [0, len("The cat sat.")]
    e0 = expl.inputs[0]
    for m in METHODS:
        want = R.segment_scores(e0.segments, e0.scores[m])
        assert seg["scores"][m] == pytest.approx(want[:-1].tolist()) and seg["outside_scores"][m] == pytest.approx(
            float(want[-1])
        )
    assert seg["outside"] == R.outside(e0.segments, len(e0.tokens)).tolist()
    again = Explanation.from_json(doc)
    assert isinstance(again, Explanation) and again.segments == expl.segments
    expl.save(tmp_path / "e")
    loaded = Analysis.load(tmp_path / "e")
    assert isinstance(loaded, Explanation) and loaded.segments == expl.segments
    assert json.loads(loaded.dumps())["inputs"][1]["segments"] == doc["inputs"][1]["segments"]
    both = Analysis.concat([loaded, loaded])
    assert both.segments == expl.segments + expl.segments  # type: ignore[attr-defined]
    plain = copy.copy(loaded)
    plain.segments = None
    with pytest.raises(MixlensError, match="segments"):
        Analysis.concat([loaded, plain])


def crafted(doc: dict, how: str) -> dict:
    doc = copy.deepcopy(doc)
    seg = doc["inputs"][0]["segments"]
    n = len(doc["inputs"][0]["tokens"])
    if how == "tokens past the input":
        seg["token_ranges"][-1] = [seg["token_ranges"][-1][0], n + 3]
    elif how == "overlapping tokens":
        seg["token_ranges"][1] = [seg["token_ranges"][0][0], seg["token_ranges"][1][1]]
    elif how == "overlapping characters":
        seg["char_ranges"][1] = [0, seg["char_ranges"][1][1]]
    elif how == "characters past the text":
        seg["char_ranges"][-1] = [seg["char_ranges"][-1][0], 10_000]
    elif how == "wrong outside":
        seg["outside"] = seg["outside"][1:]
    elif how == "scores not the sums":
        seg["scores"]["grad_x_input"][0] += 1.0
    elif how == "some inputs only":
        del doc["inputs"][1]["segments"]
    elif how == "labels not strings":
        seg["labels"][0] = 3
    elif how == "missing ranges":
        del seg["token_ranges"]
    return doc


CRAFTED = {
    "tokens past the input": "not inside the input",
    "overlapping tokens": "overlap",
    "overlapping characters": "overlap",
    "characters past the text": "not inside the text",
    "wrong outside": "'outside'",
    "scores not the sums": "not the sums of its token scores",
    "some inputs only": "some inputs only",
    "labels not strings": "labels",
    "missing ranges": "token range",
}


@pytest.mark.parametrize("how", list(CRAFTED))
def test_crafted_segments_are_one_line_from_report_and_plot(how, expl, tmp_path, capsys):
    f = tmp_path / "e.json"
    f.write_text(json.dumps(crafted(json.loads(expl.dumps()), how)))
    with pytest.raises(MixlensError, match=CRAFTED[how]):
        Analysis.load(f)
    for argv in (
        ["report", "--from", str(f), "-o", str(tmp_path / "r.html")],
        ["plot", "--view", "segments", "--from", str(f), "-o", str(tmp_path / "p.png")],
    ):
        code, _, err = run_cli(argv, capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and CRAFTED[how] in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "p.png").exists()


def test_a_saved_files_crafted_segments_are_refused(expl, tmp_path):
    expl.save(tmp_path / "e")
    man = json.loads((tmp_path / "e.json").read_text())
    man["segments"][0]["token_ranges"][0] = [0, 10_000]
    (tmp_path / "e.json").write_text(json.dumps(man))
    with pytest.raises(MixlensError, match="not inside the input"):
        Analysis.load(tmp_path / "e")
    man["segments"] = {"labels": []}
    (tmp_path / "e.json").write_text(json.dumps(man))
    with pytest.raises(MixlensError, match="one object per input"):
        Analysis.load(tmp_path / "e")


# ---- the views read from the result ----


def test_terminal_html_and_figure_views(expl, tmp_path, capsys):
    console = Console(file=io.StringIO(), width=160)
    expl.show(console)
    out = console.file.getvalue()
    assert "segments of input 2" in out and "passage 2" in out and "(outside)" in out
    page = expl.html()
    assert page.count("answer tokens × segments") == len(TEXTS) * len(METHODS)
    assert "Segments: where did the answer come from?" in page
    f = tmp_path / "e.json"
    f.write_text(expl.dumps())
    code, _, err = run_cli(["report", "--from", str(f), "-o", str(tmp_path / "r.html")], capsys)
    assert code == 0, err
    report = (tmp_path / "r.html").read_text()
    assert "Segments: where did the answer come from?" in report and "passage 3" in report
    code, _, err = run_cli(["plot", "--view", "segments", "--from", str(f), "-o", str(tmp_path / "p.png")], capsys)
    assert code == 0, err
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = V.segments_figure(expl)
    heat = [ax for ax in fig.axes if ax.get_title() == "answer tokens × segments"]
    assert len(heat) == len(TEXTS) * len(METHODS)
    img = heat[0].images[0]
    assert img.get_cmap().name == ("RdBu_r" if V.input_views(expl.inputs[0])[0].signed else "viridis")
    lo, hi = img.get_clim()
    assert lo == -hi or lo == 0  # centred at 0 (signed) or starting at 0


def test_plot_segments_needs_a_file_with_segments(expl, tmp_path, capsys):
    plain = copy.copy(expl)
    plain.segments = None
    f = tmp_path / "plain.json"
    f.write_text(plain.dumps())
    for argv, word in (
        (["plot", "--view", "segments", "--from", str(f), "-o", str(tmp_path / "p.png")], "holds no segments"),
        (["plot", "--view", "segments", "hello", "-o", str(tmp_path / "p.png")], "--from FILE"),
    ):
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and word in err and len(err.strip().splitlines()) == 1, err


# ---- an explained answer: one row per answer token (the hook `answer_matrices` reads) ----


def answered(rng: np.random.Generator):
    """An explained input of a 3-token answer after a 10-token prompt (two segments), as the views read it: each
    method's [answer, source] matrix over prompt + answer (row a: 0 from source p + a on, a causal LM's rows)."""
    p, m = 10, 3
    mat = rng.standard_normal((m, p + m))
    for a in range(m):
        mat[a, p + a :] = 0.0
    segs = [Segment("1 user", 0, 8, 1, 4), Segment("2 user", 9, 20, 5, 9)]
    answer = {"text": " in London", "tokens": [" in", " Lon", "don"], "start": p, "ids": [1, 2, 3], "logprobs": []}
    e = SimpleNamespace(
        text="x" * 20,
        target=Target("answer", -1, " in London"),
        scores={"logit_attn": mat.sum(0), "saliency": np.abs(mat).sum(0)},
        matrix={"logit_attn": mat},
        answer=answer,
        segments=segs,
    )
    return e, mat, p


def test_an_answers_matrix_gives_one_row_per_answer_token():
    e, mat, p = answered(np.random.default_rng(0))
    views = {v.method: v for v in V.input_views(e)}
    v = views["logit_attn"]
    assert v.answer == [" in", " Lon", "don"] and v.labels == ["1 user", "2 user", R.ANSWER, R.OUTSIDE]
    for a in range(3):
        assert v.matrix[a, 0] == pytest.approx(math.fsum(mat[a, 1:4].tolist()))
        assert v.matrix[a, 1] == pytest.approx(math.fsum(mat[a, 5:9].tolist()))
        assert v.matrix[a, 2] == pytest.approx(math.fsum(mat[a, p:].tolist()))  # the earlier answer tokens
        assert v.matrix[a, 3] == pytest.approx(mat[a, 0] + mat[a, 4] + mat[a, 9])  # prompt tokens in no segment
        assert v.matrix[a].sum() == pytest.approx(math.fsum(mat[a].tolist()))
    assert v.matrix[0, 2] == 0.0  # the first answer token has no earlier answer token
    ranked = v.ranked()
    assert [x for x, _ in ranked[-2:]] == [R.ANSWER, R.OUTSIDE]
    assert ranked[0][1] >= ranked[1][1]
    # a method without a matrix: its answer-level scores as one row
    s = views["saliency"]
    assert s.answer == [" in London (sum)"] and s.matrix.shape == (1, 4) and not s.signed
    expl = SimpleNamespace(inputs=[e], model="m", segments=[e.segments])
    console = Console(file=io.StringIO(), width=200)
    V.print_segments(expl, console)
    shown = console.file.getvalue()
    assert "logit_attn: answer tokens × segments" in shown and R.ANSWER in shown and " Lon" in shown
    page = V.render_html(expl)
    assert page.count("answer tokens × segments") == 2 and "don</td>" in page
    fig = V.segments_figure(expl)
    heat = [ax for ax in fig.axes if ax.get_title() == "answer tokens × segments"]
    assert heat[0].images[0].get_array().shape == (3, 4) and heat[0].images[0].get_cmap().name == "RdBu_r"
    assert heat[1].images[0].get_cmap().name == "viridis"


def test_a_real_answers_heatmap_and_its_files(lens, tmp_path):
    """`explain(..., answer=)` on the random GPT-2: one heatmap row per answer token, each row the exact sums of
    the method's [answer, source] row; saved and read back with the answer and the segments."""
    res = explain(lens, TEXTS[:1], METHODS, answer=" and more birds")
    e = res.inputs[0]
    seg = S.passages(lens.tokenizer, e.text, "||")
    start = e.answer["start"]
    assert all(s.end <= start for s in seg.segments)
    res.segments = [seg.segments]
    e = res.inputs[0]
    for v in V.input_views(e):
        mat = np.asarray(e.matrix[v.method], dtype=np.float64)  # [answer, prompt + answer]
        assert v.answer == e.answer["tokens"] and v.matrix.shape == (len(mat), len(seg.segments) + 2)
        assert v.labels[-2:] == [R.ANSWER, R.OUTSIDE]
        for a, row in enumerate(mat):
            for j, s in enumerate(seg.segments):
                assert v.matrix[a, j] == pytest.approx(math.fsum(row[s.start : s.end].tolist()), abs=1e-12)
            assert v.matrix[a, -2] == pytest.approx(math.fsum(row[start:].tolist()), abs=1e-12)
            assert v.matrix[a].sum() == pytest.approx(math.fsum(row.tolist()), abs=1e-9)
        np.testing.assert_allclose(v.totals, R.answer_segment_matrix(mat, seg.segments, start).sum(0))
    doc = json.loads(res.dumps())
    got = doc["inputs"][0]["segments"]["scores"]["decompx_logit"]  # of the answer-level scores
    want = R.segment_scores(seg.segments, np.asarray(e.scores["decompx_logit"]))[:-1]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    f = tmp_path / "a.json"
    f.write_text(res.dumps())
    again = Analysis.load(f)
    assert again.segments == res.segments and again.inputs[0].answer == e.answer  # type: ignore[attr-defined]
    assert [v.matrix.shape for v in V.input_views(again.inputs[0])] == [v.matrix.shape for v in V.input_views(e)]
