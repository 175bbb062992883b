"""`mixlens explain` with segments (--chat, --span, --marker, --separator): ranked segment scores that are the sums
of the explained tokens' scores; bad segment requests are one line, exit 2."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

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
        (["explain", "hi there", "--separator", "x", "--generate", "2"], "drop --generate"),
        (["explain"], "give one or more texts"),
    ],
)
def test_bad_segment_requests_are_one_line(capsys, args, message):
    code, out, err = run_cli(args, capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


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
