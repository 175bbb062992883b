"""`mixlens explain --answer / --generate`: the [answer × context] matrices in the JSON (read back by
`Explanation.load`), the terminal's per-answer-token lines, and bad answer requests as one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mixlens.result import Explanation
from tests.conftest import run_cli

SMOLLM = Path.home() / ".cache" / "mixlens" / "models" / "smollm2-135m-instruct"
needs_smollm = pytest.mark.skipif(not SMOLLM.is_dir(), reason="SmolLM2-135M-Instruct is not present")


@needs_smollm
def test_answer_json_holds_the_matrices(capsys, tmp_path):
    dest = tmp_path / "a.json"
    args = ["explain", "The capital of France is", "--model", str(SMOLLM), "--answer", " Paris, of course"]
    code, out, err = run_cli([*args, "--method", "logit_attn", "--format", "json", "-o", str(dest)], capsys)
    assert code == 0, err
    inp = json.loads(dest.read_text())["inputs"][0]
    answer = inp["target"]["answer"]
    assert inp["target"]["kind"] == "answer" and answer["tokens"] == [" Paris", ",", " of", " course"]
    m = inp["methods"]["logit_attn"]
    assert m["dims"] == ["target", "source"] and np.shape(m["values"]) == (4, len(inp["tokens"]))
    assert m["rows"] == list(range(answer["start"], answer["start"] + 4))
    np.testing.assert_allclose(inp["scores"]["logit_attn"], np.sum(m["values"], 0), rtol=1e-5, atol=1e-6)
    back = Explanation.load(dest)
    np.testing.assert_allclose(back["logit_attn"].input(0), m["values"], rtol=1e-6)
    code, out, err = run_cli([*args, "--method", "logit_attn"], capsys)
    assert code == 0, err
    assert "answer: ' Paris, of course' (4 tokens)" in out and "' course' (log p" in out


@needs_smollm
def test_generate_is_one_answer(capsys, tmp_path):
    dest = tmp_path / "g.json"
    code, _, err = run_cli(
        [
            "explain",
            "The capital of France is",
            "--model",
            str(SMOLLM),
            "--generate",
            "3",
            "--method",
            "logit_attn",
            "-f",
            "json",
            "-o",
            str(dest),
        ],
        capsys,
    )
    assert code == 0, err
    inputs = json.loads(dest.read_text())["inputs"]
    assert len(inputs) == 1 and len(inputs[0]["target"]["answer"]["ids"]) == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["explain", "hi there", "--answer", " yes"], "needs a causal language model"),
        (["explain", "hi there", "--answer", " yes", "--target", "1"], "drop --target"),
    ],
)
def test_bad_answer_requests(capsys, args, message):
    code, _, err = run_cli(args, capsys)
    assert code == 2 and message in err and err.count("\n") <= 1


@needs_smollm
@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--answer", " "], "empty"), (["--answer", " Paris", "--generate", "2"], "not both")],
)
def test_bad_answers_on_a_causal_lm(capsys, extra, message):
    code, _, err = run_cli(["explain", "The capital of France is", "--model", str(SMOLLM), *extra], capsys)
    assert code == 2 and message in err
