"""`mixlens explain`: targets, one score per token and method, exact decompx sums, output formats, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mixlens.errors import MixlensError
from mixlens.explain import explain
from mixlens.explain.answers import answer_prompt
from mixlens.explain.attributions import applicable, default_methods
from mixlens.methods.decompx_logit import logit_scores
from tests.conftest import SENTENCES, random_lens, run_cli

LABELS = {"id2label": {0: "negative", 1: "positive"}, "label2id": {"negative": 0, "positive": 1}}


@pytest.fixture(scope="module")
def classifier(tokenizer):
    return random_lens("bert", tokenizer, head="AutoModelForSequenceClassification", **LABELS)


@pytest.fixture(scope="module")
def causal(tokenizer):
    return random_lens("llama", tokenizer, head="AutoModelForCausalLM")


@pytest.fixture(scope="module")
def saved(tmp_path_factory, classifier, causal):
    """The two random models saved as model directories, for the CLI."""
    root = tmp_path_factory.mktemp("models")
    for name, lens in (("clf", classifier), ("lm", causal)):
        lens.model.save_pretrained(root / name)
        lens.tokenizer.save_pretrained(root / name)
    return root


def _last_logits(lens, texts):
    enc = lens.encode(texts)
    with torch.no_grad():
        logits = lens.model(**enc.inputs).logits
    last = enc.inputs["attention_mask"].sum(-1) - 1
    return logits[torch.arange(len(texts)), last]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decompx_logit_sums_to_the_target_logit(tokenizer, family):
    lens = random_lens(family, tokenizer, head="AutoModelForCausalLM", seed=3)
    tr = lens.trace(SENTENCES, ffn=True)
    rows = _last_logits(lens, SENTENCES)
    tok = torch.tensor([5, 17, 2000])
    foil = torch.tensor([-1, 3, 9])
    s = logit_scores(tr, tok, foil)
    want = rows[torch.arange(3), tok] - torch.where(foil >= 0, rows[torch.arange(3), foil.clamp_min(0)], 0.0)
    torch.testing.assert_close(s.sum(-1), want, rtol=1e-4, atol=1e-5)
    assert (s[tr.mask == 0] == 0).all()
    via_registry = lens.analyze(SENTENCES, ["decompx_logit"])["decompx_logit"].values  # registry: top token
    np.testing.assert_allclose(via_registry.sum(-1), rows.max(-1).values.numpy(), rtol=1e-4, atol=1e-5)


def test_classifier_targets_and_exact_decompx_row(classifier):
    ex = explain(classifier, SENTENCES[:2], ["decompx_classes", "grad_x_input", "attention"], target="positive")
    enc = classifier.encode(SENTENCES[:2])
    with torch.no_grad():
        logits = classifier.model(**enc.inputs).logits
    for b, e in enumerate(ex.inputs):
        assert e.target.index == 1 and e.target.label == "positive"
        assert e.score == pytest.approx(float(logits[b].softmax(-1)[1]), abs=1e-6)
        assert e.tokens == enc.tokens[b]
        assert all(len(s) == len(e.tokens) for s in e.scores.values())
        assert float(e.scores["decompx_classes"].sum()) == pytest.approx(float(logits[b, 1]), abs=1e-3)
    pred = explain(classifier, SENTENCES[:1], ["attention"])
    assert pred.inputs[0].target.index == int(logits[0].argmax())
    by_index = explain(classifier, SENTENCES[:1], ["decompx_classes"], target=0, foil="positive")
    e = by_index.inputs[0]
    assert e.target.foil == 1
    assert float(e.scores["decompx_classes"].sum()) == pytest.approx(float(logits[0, 0] - logits[0, 1]), abs=1e-3)
    assert e.score == pytest.approx(float(logits[0, 0] - logits[0, 1]), abs=1e-5)


def test_every_method_gives_one_score_per_token(classifier, causal):
    for lens in (classifier, causal):
        ex = explain(lens, ["a charming film", "The keys to the cabinet are on the table."], None)
        assert ex.methods == default_methods("classifier" if lens is classifier else "causal", lens.adapter.family)
        for e in ex.inputs:
            for m, s in e.scores.items():
                assert s.shape == (len(e.tokens),) and bool(torch.isfinite(torch.as_tensor(s)).all()), m
    assert "hta" in applicable("classifier") and "hta" not in default_methods("classifier")


def test_integrated_gradients_complete_and_occlusion_direct(classifier):
    ex = explain(classifier, SENTENCES[:1], ["integrated_gradients", "occlusion"], target=1)
    e = ex.inputs[0]
    enc = classifier.encode(SENTENCES[:1])
    emb = classifier.model.get_input_embeddings()(enc.inputs["input_ids"])
    with torch.no_grad():
        full = classifier.model(**enc.inputs).logits[0, 1]
        zero = classifier.model(
            inputs_embeds=torch.zeros_like(emb),
            attention_mask=enc.inputs["attention_mask"],
            token_type_ids=enc.inputs["token_type_ids"],
        ).logits[0, 1]
        occluded = emb.clone()
        occluded[0, 2] = 0
        drop = classifier.model(
            inputs_embeds=occluded,
            attention_mask=enc.inputs["attention_mask"],
            token_type_ids=enc.inputs["token_type_ids"],
        ).logits[0, 1]
    assert float(e.scores["integrated_gradients"].sum()) == pytest.approx(float(full - zero), abs=2e-2)
    assert float(e.scores["occlusion"][2]) == pytest.approx(float(full - drop), abs=1e-4)


def test_encoder_rows_are_the_mean_row(bundled):
    ex = explain(bundled, SENTENCES[:1], ["attention"])
    e = ex.inputs[0]
    assert e.target.kind == "embedding" and e.score == pytest.approx(1.0, abs=1e-5)
    tr = bundled.trace(SENTENCES[:1])
    want = tr.layers[-1].alpha[0].mean(0).mean(0)
    torch.testing.assert_close(torch.as_tensor(e.scores["attention"]), want.float(), rtol=1e-5, atol=1e-6)


def test_generation_explains_the_generated_answer(causal):
    ex = explain(causal, ["The keys to the"], ["decompx_logit", "saliency"], generate=3)
    assert len(ex.inputs) == 1  # one input: the 3 generated tokens are its answer (tests/explain/test_answers.py)
    (inp,) = ex.inputs
    assert inp.target.kind == "answer" and len(inp.answer["ids"]) == 3
    assert inp.matrix["saliency"].shape == (3, len(inp.tokens))
    head = answer_prompt(causal, "The keys to the")  # the prompt an answer continues (no appended [SEP])
    with torch.no_grad():
        first = causal.model(**causal.encode_ids([head]).inputs).logits[0, -1].argmax()
    assert inp.answer["ids"][0] == int(first) and inp.answer["start"] == len(head)


def test_bad_targets(classifier, causal, bundled):
    with pytest.raises(MixlensError, match="no label 'neutral'"):
        explain(classifier, SENTENCES[:1], ["attention"], target="neutral")
    with pytest.raises(MixlensError, match="class 7 out of range"):
        explain(classifier, SENTENCES[:1], ["attention"], target=7)
    with pytest.raises(MixlensError, match="is the target itself"):
        explain(causal, SENTENCES[:1], ["attention"], target="table", foil="table")
    with pytest.raises(MixlensError, match="needs a causal language model"):
        explain(classifier, SENTENCES[:1], ["attention"], generate=2)
    with pytest.raises(MixlensError, match="does not explain a classifier's prediction"):
        explain(classifier, SENTENCES[:1], ["decompx_logit"])
    with pytest.raises(MixlensError, match="one target"):
        explain(bundled, SENTENCES[:1], ["attention"], target=1)


def test_cli_json_schema_and_html(saved, tmp_path, capsys):
    rc, out, _ = run_cli(
        [
            "explain",
            "a charming film",
            "--model",
            str(saved / "clf"),
            "--method",
            "attention",
            "--method",
            "decompx_classes",
            "--target",
            "negative",
            "--format",
            "json",
        ],
        capsys,
    )
    assert rc == 0
    doc = json.loads(out)
    assert set(doc) == {"model", "version", "inputs"}
    (inp,) = doc["inputs"]
    assert {"text", "tokens", "target", "scores", "methods"} <= set(inp)  # the analysis JSON plus the short 'scores'
    assert set(inp["target"]) == {"kind", "label", "score", "index"}
    assert inp["target"]["label"] == "negative" and set(inp["scores"]) == {"attention", "decompx_classes"}
    assert all(len(v) == len(inp["tokens"]) for v in inp["scores"].values())
    page = tmp_path / "x.html"
    rc, _, _ = run_cli(
        [
            "explain",
            "a charming film",
            "--model",
            str(saved / "lm"),
            "--method",
            "decompx_logit",
            "--foil",
            "the",
            "--format",
            "html",
            "--out",
            str(page),
        ],
        capsys,
    )
    text = page.read_text()
    assert rc == 0 and "decompx_logit" in text and "<script" not in text and "http" not in text.split("<body>")[1]
    rc, out, _ = run_cli(["explain", "a charming film", "--model", str(saved / "clf"), "--method", "attention"], capsys)
    assert rc == 0 and "attention" in out and "charming" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "clf", "--target", "neutral"], "no label 'neutral'"),
        (["--model", "lm", "--target", "the", "--foil", "the"], "is the target itself"),
        (["--model", "clf", "--generate", "2"], "needs a causal language model"),
    ],
)
@pytest.mark.parametrize("fmt", ["json", "html"])
def test_cli_bad_input_one_line_exit_2(saved, tmp_path, capsys, monkeypatch, args, message, fmt):
    args = [a if a not in ("clf", "lm") else str(saved / a) for a in args]
    dest = tmp_path / "never"
    monkeypatch.chdir(tmp_path)  # html without --out would write mixlens-explain.html here
    rc, out, err = run_cli(["explain", "a charming film", "--method", "attention", "--format", fmt, *args], capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1 and out == ""
    rc, out, err = run_cli(
        ["explain", "a charming film", "--method", "attention", "--format", fmt, "--out", str(dest), *args], capsys
    )
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1 and out == ""
    assert list(tmp_path.iterdir()) == []


def test_cli_model_head_and_its_deprecated_alias(saved, capsys):
    base = ["explain", "a charming film", "--model", str(saved / "clf"), "--method", "attention", "--format", "json"]
    rc, out, err = run_cli([*base, "--model-head", "sequence-classification"], capsys)
    assert rc == 0 and "deprecated" not in err
    rc, old, err = run_cli([*base, "--head", "sequence-classification"], capsys)
    assert rc == 0 and "--head is deprecated" in err and json.loads(old) == json.loads(out)
    rc, helptext, _ = run_cli(["explain", "--help"], capsys)
    assert rc == 0 and "--model-head" in helptext and "--head" not in helptext  # the old name is hidden


def test_lens_explain_alias_and_notebook_view(classifier):
    """explain is a function on a lens; `Lens.explain` stays as a deprecated alias giving the same result."""
    ex = explain(classifier, ["a charming film"], ["attention"])
    assert "mlx-tok" in ex._repr_html_() and ex.to_json()["inputs"][0]["text"] == "a charming film"
    with pytest.warns(DeprecationWarning, match="use mixlens.explain.explain"):
        old = classifier.explain(["a charming film"], ["attention"])
    assert old.to_json() == ex.to_json()


def test_token_budget_shrinks_for_large_models(bundled):
    from types import SimpleNamespace

    from mixlens.methods.perturbation import ACTIVATION_FLOATS, TOKEN_BUDGET, token_budget

    assert token_budget(bundled.model) == TOKEN_BUDGET  # the bundled 6-layer, d = 384 encoder: the full budget

    class BigForCausalLM(torch.nn.Module):  # SmolLM2-135M's sizes
        config = SimpleNamespace(hidden_size=576, num_hidden_layers=30, vocab_size=49152)

    want = ACTIVATION_FLOATS // (24 * 576 * 30 + 2 * 49152)
    assert token_budget(BigForCausalLM()) == want and 64 < want < TOKEN_BUDGET


def test_html_legend_names_signed_colours_only_for_signed_scores(bundled):
    """The legend says 'blue: against the target' only when some method gave a negative score (#32 item 9)."""
    unsigned = explain(bundled, ["a fine film"], ["saliency", "attention"]).html()
    signed = explain(bundled, ["a fine film"], ["grad_x_input"]).html()
    assert "blue against it" not in unsigned and "deeper red = larger" in unsigned
    assert "blue against it" in signed


def test_an_explanation_is_an_analysis(bundled, tmp_path, capsys):
    """explain returns an Analysis: it saves, loads (both formats), concatenates, and `report --from` draws it."""
    import mixlens
    from mixlens.result import Analysis, Explanation

    ex = explain(bundled, SENTENCES[:2], ["saliency", "grad_x_input", "attention_rollout"])
    assert isinstance(ex, Analysis) and isinstance(ex, Explanation) and ex["saliency"].dims == ("source",)
    assert [len(e.tokens) for e in ex.inputs] == [len(t) for t in ex.tokens]
    ex.save(tmp_path / "ex")
    back = mixlens.Analysis.load(tmp_path / "ex")
    assert isinstance(back, Explanation) and back.explained == ex.explained
    (tmp_path / "ex_json.json").write_text(ex.dumps())
    again = mixlens.Analysis.load(tmp_path / "ex_json.json")
    assert isinstance(again, Explanation) and [e.target.label for e in again.inputs] == [
        e.target.label for e in ex.inputs
    ]
    for m in ex.methods:
        for b in range(2):
            np.testing.assert_allclose(back[m].input(b), ex[m].input(b))
            np.testing.assert_allclose(again[m].input(b), ex[m].input(b), rtol=1e-6, atol=1e-7)
    both = mixlens.Analysis.concat([ex, back])
    assert isinstance(both, Explanation) and len(both) == 4 and both.explained == ex.explained * 2
    with pytest.raises(MixlensError, match="other methods"):
        mixlens.Analysis.concat([ex, bundled.analyze(SENTENCES[:1], ["attention"])])
    rc, _, err = run_cli(
        ["report", "--from", str(tmp_path / "ex_json.json"), "--out", str(tmp_path / "r.html")], capsys
    )
    assert rc == 0 and "grad_x_input" in (tmp_path / "r.html").read_text(), err


def test_a_crafted_explained_target_is_refused(bundled, tmp_path):
    import mixlens

    doc = json.loads(explain(bundled, SENTENCES[:1], ["saliency"]).dumps())
    doc["inputs"][0]["target"] = {"kind": "class", "label": 3, "score": "high"}
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(MixlensError, match="target must have a string kind and label"):
        mixlens.Analysis.load(tmp_path / "bad.json")


@pytest.mark.parametrize("spec", ["²", "³", "--1"])
def test_unicode_digits_are_not_class_indices(saved, spec, capsys):
    """#32.15: `--target ²` on a classifier is one line (unicode digits never reach int())."""
    rc, _, err = run_cli(
        ["explain", "a charming film", "--model", str(saved / "clf"), "--method", "attention", f"--target={spec}"],
        capsys,
    )
    assert rc == 2 and f"no label '{spec}'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_valid_methods_listed_are_those_the_family_runs():
    """#45 item 24: MPNet's "valid methods" list named flow_routes_tokens, which the family then refused."""
    from mixlens.adapters import FAMILIES
    from mixlens.explain.attributions import check_methods

    mpnet = next(f for f in FAMILIES if f.name == "mpnet")
    with pytest.raises(MixlensError, match="does not explain an encoder's prediction; valid: ") as e:
        check_methods("encoder", ["decompx_logit"], mpnet)
    valid = str(e.value).split("valid: ")[1].split(", ")
    assert "flow_routes_tokens" not in valid and "attention" in valid
    for m in valid:
        assert check_methods("encoder", [m], mpnet) == [m]
