"""`mixlens explain` with segments (--chat, --span, --marker, --separator): ranked segment scores that are the sums
of the explained tokens' scores; bad segment requests are one line, exit 2."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from mixlens.result import Analysis
from mixlens.viz.segments import input_views
from tests.conftest import run_cli

SMOLLM = Path.home() / ".cache" / "mixlens" / "models" / "smollm2-135m-instruct"


def printed_segments(out: str) -> dict[str, dict[str, float]]:
    """method → label → score, from the segment lists on stdout."""
    doc: dict[str, dict[str, float]] = {}
    method = None
    for line in out[out.index("segments of input 1") :].splitlines()[1:]:
        if re.fullmatch(r"  \S+:", line):
            method = line.strip()[:-1]
            doc[method] = {}
        elif line.startswith("    ") and method:
            label, value = line.strip().rsplit(None, 1)
            doc[method][label] = float(value)
    return doc


def test_separator_segments_are_sums_of_the_token_scores(capsys, tmp_path):
    out_json = tmp_path / "e.json"
    text = "The cat sat. || A dog ran far. || Birds sing."
    code, out, err = run_cli(
        ["explain", text, "--separator", "||", "--method", "grad_x_input", "-o", str(out_json)], capsys
    )
    assert code == 0, err
    shown = printed_segments(out)["grad_x_input"]
    assert list(shown)[:3] == sorted(list(shown)[:3], key=lambda k: -shown[k])  # ranked
    inp = json.loads(out_json.read_text())["inputs"][0]
    tokens, scores = inp["tokens"], inp["scores"]["grad_x_input"]
    bars = [i for i, t in enumerate(tokens) if t == "|"]  # the bundled tokenizer splits '||' into two '|'
    assert len(bars) == 4
    parts = {
        "passage 1": range(1, bars[0]),
        "passage 2": range(bars[1] + 1, bars[2]),
        "passage 3": range(bars[3] + 1, len(tokens) - 1),
    }
    for label, idx in parts.items():
        assert math.isclose(shown[label], math.fsum(scores[i] for i in idx), rel_tol=1e-3, abs_tol=1e-6)
    outside = [0, *bars, len(tokens) - 1]
    assert math.isclose(shown["(outside)"], math.fsum(scores[i] for i in outside), rel_tol=1e-3, abs_tol=1e-6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["explain", "hi there", "--span", "0:50"], "outside the text"),
        (["explain", "hi there", "--span", "a-b"], "START:END"),
        (["explain", "hi there", "--marker", "Doc:"], "'Doc:' does not occur"),
        (["explain", "hi there", "--separator", "||"], "does not occur"),
        (["explain", "hi", "--chat", "[]"], "give no TEXT"),
        (["explain", "--chat", "[]"], "non-empty JSON list"),
        (["explain", "--chat", "missing-chat.json"], "does not exist"),
        (["explain", "--chat", '[{"role": "user", "content": "hi"}]'], "no chat template"),
        (["explain", "hi there", "--span", "0:2", "--separator", "x"], "one kind of segments"),
        (["explain"], "give one or more texts"),
        # #43 item 6: each bad chat or segment request is one line, before the model loads
        (["explain", "--chat", "[{"], "not valid JSON"),
        (["explain", "--chat", '["hi"]'], "message 1 is not a"),
        (["explain", "--chat", '[{"content": "hi"}]'], "message 1 has no 'role'"),
        (["explain", "--chat", '[{"role": "user"}]'], "message 1 has no 'content'"),
        (["explain", "--chat", '[{"role": "user", "content": 3}]'], "message 1's content is int, not a string"),
        (["explain", "--chat", '[{"role": "user", "content": "hi"}, {"role": 1, "content": "x"}]'], "message 2's role"),
        (["explain", "--chat", '[{"role": "user", "content": " "}]'], "empty role or content"),
        (["explain", "hi there", "--span", "0:5", "--span", "3:8"], "overlap"),
        (["explain", "hi there", "--span", "4:4"], "outside the text of 8 characters or empty"),
        (["explain", "hi there", "ok then", "--span", "0:8"], "text 2: span 'span 1' [0, 8) is outside"),
        (["explain", "hi there", "--marker", ""], "markers must be non-empty"),
        (["explain", "hi there", "--separator", ""], "separator must be a non-empty string"),
        (["explain", "hi there", "--format", "png"], "--format png draws the segments"),
        (["explain", "hi there", "--separator", " ", "--format", "png", "-o", "x.svg"], "writes a .png file"),
    ],
)
def test_bad_segment_requests_are_one_line(capsys, args, message):
    code, out, err = run_cli(args, capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_chat_file_that_is_not_a_list_of_messages(capsys, tmp_path):
    f = tmp_path / "chat.json"
    f.write_text('{"role": "user", "content": "hi"}')
    code, _, err = run_cli(["explain", "--chat", str(f)], capsys)
    assert code == 2 and f"chat file '{f}' must be a non-empty JSON list" in err and len(err.splitlines()) == 1, err


def test_segments_in_every_format(capsys, tmp_path):
    """--separator with --format json, html and png: the segments are in the JSON (sums of the token scores), the
    HTML page and the figure."""
    text = "The cat sat. || A dog ran far. || Birds sing."
    args = ["explain", text, "--separator", "||", "--method", "grad_x_input"]
    code, out, err = run_cli([*args, "--format", "json"], capsys)
    assert code == 0, err
    inp = json.loads(out)["inputs"][0]
    seg, scores = inp["segments"], inp["scores"]["grad_x_input"]
    assert seg["labels"] == ["passage 1", "passage 2", "passage 3"]
    for (a, b), value in zip(seg["token_ranges"], seg["scores"]["grad_x_input"], strict=True):
        assert math.isclose(value, math.fsum(scores[a:b]), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(seg["outside_scores"]["grad_x_input"], math.fsum(scores[i] for i in seg["outside"]))
    code, _, err = run_cli([*args, "--format", "html", "-o", str(tmp_path / "e.html")], capsys)
    assert code == 0, err
    page = (tmp_path / "e.html").read_text()
    assert "Segments: where did the answer come from?" in page and "passage 3" in page
    code, _, err = run_cli([*args, "--format", "png", "-o", str(tmp_path / "e.png")], capsys)
    assert code == 0 and "wrote the segments figure" in err, err
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"


def test_a_role_the_template_does_not_know_is_named(capsys, tmp_path):
    """A chat template that raises for an unknown role: one line naming the message and its role."""
    if not (SMOLLM / "model.safetensors").is_file():
        pytest.skip("smollm2-135m-instruct not fetched (python scripts/fetch_models.py smollm2-135m-instruct)")
    model = tmp_path / "model"
    model.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (model / f).symlink_to(SMOLLM / f)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = [{"role": "user", "content": "Hello."}, {"role": "narrator", "content": "Once upon a time"}]
    code, _, err = run_cli(["explain", "--model", str(model), "--chat", json.dumps(chat)], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("explaining with")]
    assert code == 2 and len(lines) == 1, err
    assert "rejects message 2 (role 'narrator'): Unknown role: narrator" in lines[0]


def test_chat_segments_on_smollm2(capsys, tmp_path):
    if not (SMOLLM / "model.safetensors").is_file():
        pytest.skip("smollm2-135m-instruct not fetched (python scripts/fetch_models.py smollm2-135m-instruct)")
    chat = [
        {"role": "user", "content": "The access code of the archive room is 4721."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "What is the access code of the archive room?"},
    ]
    dest = tmp_path / "chat.json"
    code, out, err = run_cli(
        ["explain", "--model", str(SMOLLM), "--chat", json.dumps(chat), "--method", "logit_attn", "-o", str(dest)],
        capsys,
    )
    assert code == 0, err
    shown = printed_segments(out)["logit_attn"]
    assert set(shown) == {"1 user", "2 assistant", "3 user", "(outside)"}
    inp = json.loads(dest.read_text())["inputs"][0]
    assert inp["text"].startswith("<|im_start|>system") and inp["text"].endswith("<|im_start|>assistant\n")
    total = math.fsum(inp["scores"]["logit_attn"])  # the segments and the template's tokens add up to it
    assert math.isclose(math.fsum(shown.values()), total, rel_tol=1e-3, abs_tol=1e-3)


def test_segments_of_a_generated_answer(capsys):
    """--generate N explains the generated answer as a whole, so segments of its prompt work with it: the JSON
    holds the answer and each passage's score, the sum of its prompt tokens' answer-level scores."""
    if not (SMOLLM / "model.safetensors").is_file():
        pytest.skip("smollm2-135m-instruct not fetched (python scripts/fetch_models.py smollm2-135m-instruct)")
    text = "The code of the red door is 41. || The code of the blue door is 73. || The code of the red door is"
    args = ["explain", text, "--model", str(SMOLLM), "--separator", "||", "--generate", "2", "--method", "logit_attn"]
    code, out, err = run_cli([*args, "--format", "json"], capsys)
    assert code == 0, err
    inp = json.loads(out)["inputs"][0]
    assert len(inp["target"]["answer"]["ids"]) == 2
    seg, scores = inp["segments"], inp["scores"]["logit_attn"]
    assert seg["labels"] == ["passage 1", "passage 2", "passage 3"]
    for (a, b), value in zip(seg["token_ranges"], seg["scores"]["logit_attn"], strict=True):
        assert math.isclose(value, math.fsum(scores[a:b]), rel_tol=1e-6, abs_tol=1e-9)


def test_a_generated_answers_segments_on_smollm2(capsys, tmp_path):
    """--chat with --generate: one answer, its tokens × the conversation's messages in the JSON, the HTML and the
    figure; each heatmap row adds up to the answer token's row of token scores."""
    if not (SMOLLM / "model.safetensors").is_file():
        pytest.skip("smollm2-135m-instruct not fetched (python scripts/fetch_models.py smollm2-135m-instruct)")
    chat = [
        {"role": "user", "content": "Tom lives in London."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Where does Tom live?"},
    ]
    base = ["explain", "--model", str(SMOLLM), "--chat", json.dumps(chat), "--generate", "3", "--method", "logit_attn"]
    code, _, err = run_cli([*base, "-f", "json", "-o", str(tmp_path / "a.json")], capsys)
    assert code == 0, err
    inp = json.loads((tmp_path / "a.json").read_text())["inputs"][0]
    assert inp["segments"]["labels"] == ["1 user", "2 assistant", "3 user"]
    start = inp["target"]["answer"]["start"]
    assert all(b <= start for _, b in inp["segments"]["token_ranges"])
    (v,) = input_views(Analysis.load(tmp_path / "a.json").inputs[0])
    assert len(v.answer) == 3 and v.labels[-2:] == ["(answer)", "(outside)"]
    rows = inp["methods"]["logit_attn"]["values"]  # [answer, source]
    for a in range(3):
        assert math.isclose(float(v.matrix[a].sum()), math.fsum(rows[a]), rel_tol=1e-9, abs_tol=1e-9)
    code, _, err = run_cli(
        ["plot", "--view", "segments", "--from", str(tmp_path / "a.json"), "-o", str(tmp_path / "a.png")], capsys
    )
    assert code == 0, err


def test_a_given_answers_segments_in_html_and_png_on_smollm2(capsys, tmp_path):
    """explain --answer TEXT --chat: the HTML page and the figure hold one heatmap row per answer token."""
    if not (SMOLLM / "model.safetensors").is_file():
        pytest.skip("smollm2-135m-instruct not fetched (python scripts/fetch_models.py smollm2-135m-instruct)")
    chat = [{"role": "user", "content": "Tom lives in London."}, {"role": "user", "content": "Where does Tom live?"}]
    base = ["explain", "--model", str(SMOLLM), "--chat", json.dumps(chat), "--answer", "In London.", "--method"]
    code, _, err = run_cli([*base, "logit_attn", "-f", "html", "-o", str(tmp_path / "a.html")], capsys)
    assert code == 0, err
    page = (tmp_path / "a.html").read_text()
    heat = page[page.index("logit_attn: answer tokens × segments") :]
    heat = heat[: heat.index("</table>")]
    assert heat.count("<tr>") == 1 + 3 and "<th>(answer)</th>" in heat  # the header, 'In', ' London', '.'
    code, _, err = run_cli([*base, "logit_attn", "-f", "png", "-o", str(tmp_path / "a.png")], capsys)
    assert code == 0 and (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG", err
