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
    assert rc == 2 and "holds per-layer rows of logit_attn and alti_logit: choose one with --method" in err
    rc, _, err = run_cli(
        ["plot", "--view", "logit-layers", "--from", str(src), "--method", "alti_logit", "--out", str(png)], capsys
    )
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


def test_one_layered_method_is_drawn_and_named(causal, tmp_path, capsys):
    src = tmp_path / "e.json"
    src.write_text(explain(causal, TEXTS[:1], ["alti_logit", "saliency"], target="the", foil="a").dumps())
    rc, _, err = run_cli(
        ["plot", "--view", "logit-layers", "--from", str(src), "--out", str(tmp_path / "f.png")], capsys
    )
    assert rc == 0 and f"drawing alti_logit, the method of {src} with per-layer rows" in err
    argv = [
        "plot",
        "--view",
        "logit-layers",
        "--from",
        str(src),
        "--method",
        "attention",
        "--out",
        str(tmp_path / "g.png"),
    ]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and "draws logit_attn or alti_logit, not 'attention'" in err


@pytest.mark.parametrize("method", ["alti_logit", "logit_attn"])
def test_sum_row_closes_to_the_logit_difference(expl, method):
    """#45 item 8: the figure's sum row says how it totals the logit difference, with the remainder that closes it."""
    import re

    from mixlens.viz.logit_layers import logit_layers_figure

    fig = logit_layers_figure(expl, [0, 1], method)
    labels = [ax.get_xlabel() for ax in fig.axes if ax.get_xlabel().startswith("Σ tokens")]
    assert len(labels) == 2
    for label, e in zip(labels, expl.inputs, strict=True):
        tokens, rest, total = (
            float(x) for x in re.match(r"Σ tokens (\S+) \+ rest (\S+) .*= (\S+), the logit difference$", label).groups()
        )
        assert tokens == pytest.approx(float(e.scores[method].sum()), rel=1e-3, abs=1e-4)
        assert tokens + rest == pytest.approx(e.score, rel=1e-3, abs=1e-3)  # the model's own logit difference
        assert total == pytest.approx(e.score, rel=1e-3, abs=1e-3)
    assert "the logit difference" in expl.html() and "+ rest " in expl.html()


def test_logit_layers_is_documented():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for doc in ("guides/reports.md", "reference/cli.md"):
        assert "--view logit-layers" in (root / "docs" / doc).read_text(encoding="utf-8"), doc
