"""explain keeps each method's extras per input; ALTI-Logit's per-layer view in the HTML and as a figure."""

from __future__ import annotations

import numpy as np
import pytest

from mixlens.explain import explain
from mixlens.result import Analysis
from tests.conftest import random_lens, run_cli

TEXTS = ["The keys to the cabinet are", "A dog barked and then it"]


@pytest.fixture(scope="module")
def causal(tokenizer):
    return random_lens("gpt2", tokenizer, head="AutoModelForCausalLM")


@pytest.fixture(scope="module")
def expl(causal):
    return explain(causal, TEXTS, ["alti_logit", "logit_attn", "saliency"], target="the", foil="a")


def test_explain_keeps_extras_and_probabilities(expl, causal, tmp_path):
    n_layers = causal.model.config.n_layer
    for b, inp in enumerate(expl.inputs):
        layers = inp.extras["alti_logit"]["layers"]
        assert layers.shape == (n_layers, len(inp.tokens))
        np.testing.assert_allclose(layers.sum(0), inp.scores["alti_logit"], atol=1e-5)
        rem = float(inp.extras["alti_logit"]["remainder"])
        assert inp.scores["alti_logit"].sum() + rem == pytest.approx(inp.score, abs=1e-4)  # = the logit difference
        assert 0 < inp.probability < 1 and 0 < inp.foil_probability < 1
        assert "saliency" not in inp.extras  # a method without extras has none
        assert expl["logit_attn"].extra_store["heads"].row(b).shape[-1] == len(inp.tokens)
    for path in (tmp_path / "e", tmp_path / "e.json"):
        if path.suffix == ".json":
            path.write_text(expl.dumps())
        else:
            expl.save(path)
        back = Analysis.load(path)
        for a, b in zip(back.inputs, expl.inputs, strict=True):
            np.testing.assert_allclose(a.extras["alti_logit"]["layers"], b.extras["alti_logit"]["layers"], rtol=1e-6)
            assert a.probability == pytest.approx(b.probability) and a.foil_probability == pytest.approx(
                b.foil_probability
            )


def test_html_has_the_per_layer_view(expl, causal):
    page = expl.html()
    n_layers = causal.model.config.n_layer
    assert page.count('class="mlx-ll"') == 2 * len(TEXTS)  # alti_logit and logit_attn, per input
    assert page.count("<th>layer 0</th>") == 2 * len(TEXTS) and "<th>sum</th>" in page
    assert f"<th>layer {n_layers - 1}</th>" in page and f"<th>layer {n_layers}</th>" not in page
    assert "vs foil &#x27;a&#x27; (p = " in page and "Ġ" not in page


def test_plot_logit_layers(expl, causal, tmp_path, capsys):
    src = tmp_path / "e.json"
    src.write_text(expl.dumps())
    png = tmp_path / "f.png"
    rc, _, err = run_cli(["plot", "--view", "logit-layers", "--from", str(src), "--out", str(png)], capsys)
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = run_cli(
        [
            "plot",
            "--view",
            "logit-layers",
            "--from",
            str(src),
            "--method",
            "logit_attn",
            "--out",
            str(tmp_path / "g.svg"),
        ],
        capsys,
    )
    assert rc == 0, err
    plain = tmp_path / "p.json"
    plain.write_text(explain(causal, TEXTS[:1], ["saliency"]).dumps())
    rc, _, err = run_cli(["plot", "--view", "logit-layers", "--from", str(plain), "--out", str(png)], capsys)
    assert rc == 2 and "alti_logit" in err
