"""`mixlens report --target / --foil` (issue 45, item 2): given to every method that declares the target options,
said in the report; the mixing-ratio panel hidden when no method gives ratios."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mixlens.result import Attribution
from mixlens.viz import html as vh
from tests.conftest import random_lens, run_cli
from tests.results.test_viz import NODE_DOM

SMOLLM = Path(os.environ.get("MIXLENS_MODELS", Path.home() / ".cache" / "mixlens" / "models")) / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def lm(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("lm") / "lm"
    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM")
    lens.model.save_pretrained(folder)
    lens.tokenizer.save_pretrained(folder)
    return folder, lens


def payload_of(page: Path) -> dict:
    return json.loads(re.search(r'<script type="application/json"[^>]*>(.*?)</script>', page.read_text(), re.S)[1])


def scores(payload: dict, method: str) -> np.ndarray:
    entry = next(e for e in payload["scores"] if e["name"] == method)
    return np.array(entry["rows"][0]["values"], dtype=float)


def test_target_and_foil_reach_every_method_that_takes_them(lm, tmp_path, capsys):
    folder, lens = lm
    text = "The keys to the cabinet"
    base = ["report", text, "--model", str(folder), "--method", "alti_logit", "--method", "attnlrp", "--no-heads"]
    code, _, err = run_cli(
        [*base, "--method", "attention", "--target", "cat", "--foil", "dog", "-o", str(tmp_path / "a.html")], capsys
    )
    assert code == 0, err
    got = payload_of(tmp_path / "a.html")
    cat, dog = lens.tokenizer.convert_tokens_to_ids(["cat", "dog"])
    want = lens.analyze(
        [text], ["alti_logit", "attnlrp"], options={m: {"target": cat, "foil": dog} for m in ("alti_logit", "attnlrp")}
    )
    for m in ("alti_logit", "attnlrp"):
        np.testing.assert_allclose(scores(got, m), want[m].input(0), rtol=1e-3, atol=1e-6)
    assert (
        "Per-token scores explain, at the prediction's position — alti_logit, attnlrp: target 'cat' minus foil 'dog'"
        in got["notes"][0]
    )
    code, _, err = run_cli([*base, "-o", str(tmp_path / "b.html")], capsys)
    plain = payload_of(tmp_path / "b.html")
    assert "alti_logit, attnlrp: the model's own prediction" in plain["notes"][0]
    assert not np.allclose(scores(plain, "alti_logit"), scores(got, "alti_logit"))


def test_target_errors(lm, tmp_path, capsys):
    folder, _ = lm
    argv = ["report", "The keys", "--model", str(folder), "--no-heads", "-o", str(tmp_path / "a.html")]
    code, _, err = run_cli([*argv, "--method", "attention", "--target", "cat"], capsys)
    assert code == 2 and "none of attention takes a target" in err
    code, _, err = run_cli(
        [*argv, "--method", "alti_logit", "--target", "cat", "--option", "alti_logit.target=5"], capsys
    )
    assert code == 2 and "give the target once" in err
    code, _, err = run_cli(
        ["report", "--from", str(tmp_path / "x.json"), "--target", "cat", "-o", str(tmp_path / "b.html")], capsys
    )
    assert code == 2 and "a saved one (--from) has its own" in err


def test_a_text_target_keeps_its_leading_space(tmp_path, capsys):
    if not (SMOLLM / "config.json").is_file():
        pytest.skip("smollm2-135m-instruct not fetched (python scripts/fetch_models.py smollm2-135m-instruct)")
    argv = ["report", "The keys to the cabinet", "--model", str(SMOLLM), "--method", "logit_attn", "--no-heads"]
    code, _, err = run_cli([*argv, "--target", " are", "--foil", " is", "-o", str(tmp_path / "a.html")], capsys)
    assert code == 0, err
    assert "logit_attn: target ' are' minus foil ' is'" in payload_of(tmp_path / "a.html")["notes"][0]


NODE_RATIO = (
    NODE_DOM.split("const m = root.mixlens.map()")[0]
    + """
const card = find(root, (e) => e.attrs && e.attrs["data-role"] === "ratio-card");
console.log(JSON.stringify({ hidden: card.style.display === "none" }));
"""
)


@pytest.mark.parametrize("ratios", [None, {"W": [0.5, 0.25]}])
def test_ratio_panel_is_hidden_without_ratios(ratios):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    v = np.random.default_rng(0).random((1, 2, 3, 3)).astype(np.float32)
    payload = vh.build_payload(Attribution(v, ("layer", "target", "source"), [["a", "b", "c"]], "m"))
    payload["inputs"][0]["ratios"] = ratios
    run = subprocess.run(
        [node, "-e", vh.asset("report.js") + NODE_RATIO], input=json.dumps(payload), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["hidden"] is (ratios is None)
