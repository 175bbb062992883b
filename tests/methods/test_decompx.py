"""DecompX: class scores sum to the real logits on every family (both value-bias conventions), per-layer parts
sum to the real layer outputs, the default value-bias convention is the official code's (first layer worked out
by hand on the real model), the AbsDot bias rule by hand, batched == unbatched, and errors through the real CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import mixlens
from mixlens.methods import decompx as dx
from mixlens.methods.registry import refused_by
from tests.conftest import FAMILIES, SENTENCES, has_head, random_lens, run_cli

HEAD = "AutoModelForSequenceClassification"


def check_exact(lens: mixlens.Lens, texts: list[str], value_bias: dx.ValueBias = "values") -> None:
    tr = lens.trace(texts, ffn=True)
    for b, n in enumerate(tr.lengths):
        dec = dx.decompose(tr, b, value_bias)
        logits = tr.logits[b].float()
        rel = (dec.classes.sum(-1) - logits).abs().max() / logits.abs().max()
        assert rel < 1e-3, rel
        assert dec.error == pytest.approx(rel.item(), abs=1e-6)
        for layer, lt in enumerate(tr.layers):  # every layer's parts sum to the real layer output
            real = lt.out[b, :n].float()
            assert (dec.sums[layer] - real).abs().max() < 1e-4 * max(1.0, real.abs().max().item()), layer
        layers = dx.decompx(tr, value_bias=value_bias)[b, :, :n, :n]
        np.testing.assert_allclose(dec.layers.numpy(), layers.numpy(), rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("value_bias", dx.VALUE_BIAS)
def test_scores_sum_to_logits_every_family(family, value_bias, tokenizer):
    if not has_head(family, HEAD):
        pytest.skip("transformers has no sequence classifier for this family (decompx_logit: test_capabilities.py)")
    lens = random_lens(family, tokenizer, head=HEAD, num_labels=3)
    if "decompx" in refused_by(lens.adapter.family):
        pytest.skip("DecompX refuses this family (tested in test_real_models.py)")
    check_exact(lens, SENTENCES, value_bias)


@pytest.fixture(scope="module")
def classifier() -> mixlens.Lens:
    torch.manual_seed(0)  # the classification head is randomly initialised
    return mixlens.load(head="sequence-classification", allow_random_head=True)  # random classifier on purpose


@pytest.mark.parametrize("value_bias", dx.VALUE_BIAS)
def test_scores_sum_to_logits_bundled(classifier, value_bias):
    check_exact(classifier, SENTENCES, value_bias)


def _absdot(parts: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """parts [i, k, D] + bias shared over k by |b·z_k| (no part here has a zero dot product)."""
    w = np.abs(parts @ bias)
    return parts + (w / w.sum(-1, keepdims=True))[..., None] * bias


def _first_layer_official(tr, m) -> np.ndarray:
    """‖x¹_{i⇐k}‖ of a BERT's first layer with the official code's value bias, in float64 from the weights:
    y_{i⇐k} = [i=k] x_i + Σ_h α^h_ik (x_k W_V^h + b_V^h) W_O^h + AbsDot(b_O), then LN1, FFN (θ = act/pre) and
    LN2, each bias shared by AbsDot."""
    lt, layer = tr.layers[0], m.bert.encoder.layer[0]
    att, n = layer.attention, tr.lengths[0]
    f64 = lambda t: t.detach().double().numpy()  # noqa: E731
    x, alpha = f64(lt.x[0, :n]), f64(lt.alpha[0, :, :n, :n])  # [n, d], [H, n, n]
    heads, d = alpha.shape[0], x.shape[-1]
    v = (x @ f64(att.self.value.weight).T + f64(att.self.value.bias)).reshape(n, heads, -1)  # [k, H, d_head]
    w_o = f64(att.output.dense.weight).T.reshape(heads, -1, d)  # [H, d_head, d]
    y = np.einsum("hik,khe,hed->ikd", alpha, v, w_o)
    y[np.arange(n), np.arange(n)] += x
    y = _absdot(y, f64(att.output.dense.bias))

    def norm(parts: np.ndarray, real_in: np.ndarray, ln: torch.nn.LayerNorm) -> np.ndarray:
        c = parts - parts.mean(-1, keepdims=True)
        s = np.sqrt(real_in.var(-1) + ln.eps)[:, None, None]
        return _absdot(c / s * f64(ln.weight), f64(ln.bias))

    z1 = norm(y, f64(lt.mix_in[0, :n]), att.output.LayerNorm)
    pre, act = f64(lt.ffn_pre[0, :n]), f64(lt.ffn_act[0, :n])
    h = _absdot(z1 @ f64(layer.intermediate.dense.weight).T, f64(layer.intermediate.dense.bias)) * (act / pre)[:, None]
    f = _absdot(h @ f64(layer.output.dense.weight).T, f64(layer.output.dense.bias))
    out = norm(z1 + f, f64(lt.ln_out_in[0, :n]), layer.output.LayerNorm)
    np.testing.assert_allclose(out.sum(1), f64(lt.out[0, :n]), atol=1e-4)  # the hand computation is exact too
    return np.linalg.norm(out, axis=-1)


def test_default_value_bias_is_the_official_one(classifier):
    """On the real model the first layer's parts follow the official convention by default (and through the
    registry); the AbsDot-shared value bias gives visibly different parts, so swapping the default fails here."""
    tr = classifier.trace(SENTENCES[:1], ffn=True)
    expect = _first_layer_official(tr, classifier.model)
    top = expect.max()
    default, shared = dx.decompose(tr, 0), dx.decompose(tr, 0, "absdot")
    assert np.abs(default.layers[0].numpy() - expect).max() / top < 1e-5
    assert np.abs(shared.layers[0].numpy() - expect).max() / top > 1e-2
    res = classifier.analyze(SENTENCES[:1], ["decompx_classes"])["decompx_classes"]
    np.testing.assert_allclose(res.values[0], default.classes.numpy(), rtol=1e-5, atol=1e-6)
    assert (default.classes - shared.classes).abs().max() > 1e-2 * default.classes.abs().max()


def test_batched_equals_unbatched(classifier):
    batched = classifier.analyze(SENTENCES, ["decompx", "decompx_classes"], batch_size=3)
    single = classifier.analyze(SENTENCES, ["decompx", "decompx_classes"], batch_size=1)
    for name in ("decompx", "decompx_classes"):
        np.testing.assert_allclose(batched[name].values, single[name].values, atol=1e-5, rtol=1e-4)
    cls = batched["decompx_classes"]
    assert cls.dims == ("class", "source") and cls.values.shape[:2] == (3, 2)
    n = [len(t) for t in batched.tokens]
    assert all(np.abs(cls.values[b, :, n[b] :]).max(initial=0) == 0 for b in range(3))  # padding is 0


def test_absdot_bias_sharing_by_hand():
    parts = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0]]])  # [target, k=3, D=2]
    bias = torch.tensor([1.0, 1.0])  # |b·z_k| = 1, 2, 3 → shares 1/6, 2/6, 3/6 of b
    out = dx.share(parts, bias)
    expect = parts + torch.tensor([1 / 6, 2 / 6, 3 / 6])[None, :, None] * bias
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(out.sum(1), parts.sum(1) + bias)
    zero = dx.share(torch.zeros(1, 4, 2), bias)  # no direction to follow: shared evenly
    torch.testing.assert_close(zero, torch.full((1, 4, 2), 0.25))


def test_known_answer_hand_built(tokenizer):
    """1 layer, uniform attention, W_V = W_O = I, FFN = 0, plain LayerNorms, identity pooler weights, no biases:
    x_{CLS⇐k} = C([k=0] x_0 + x_k/n) / (s1 s2), pooled part = tanh(p)/p ⊙ that, score = W_c · pooled part."""
    lens = random_lens(
        "bert", tokenizer, head=HEAD, hidden_size=8, num_attention_heads=2, intermediate_size=16, num_hidden_layers=1
    )
    m = lens.model
    with torch.no_grad():
        layer = m.bert.encoder.layer[0]
        att = layer.attention
        for lin in (att.self.query, att.self.key, layer.intermediate.dense, layer.output.dense):
            lin.weight.zero_()
            lin.bias.zero_()
        for lin in (att.self.value, att.output.dense, m.bert.pooler.dense):
            lin.weight.copy_(torch.eye(8))
            lin.bias.zero_()
        for ln in (att.output.LayerNorm, layer.output.LayerNorm):
            ln.weight.fill_(1.0)
            ln.bias.zero_()
        m.classifier.bias.zero_()
    tr = lens.trace(SENTENCES[2:], ffn=True)
    n, eps = tr.lengths[0], 1e-12
    x = tr.layers[0].x[0, :n].double().numpy()
    parts = x / n
    parts[0] += x[0]
    parts -= parts.mean(-1, keepdims=True)  # C(y_{0⇐k})
    y0 = parts.sum(0)
    s1 = np.sqrt(y0.var() + eps)
    s2 = np.sqrt((y0 / s1).var() + eps)
    parts /= s1 * s2
    p = parts.sum(0)
    pooled = parts * (np.tanh(p) / p)
    expect = pooled @ m.classifier.weight.detach().double().numpy().T  # [k, C]
    np.testing.assert_allclose(dx.decompose(tr, 0).classes.numpy(), expect.T, rtol=1e-4, atol=1e-7)


def test_cli_without_classification_head(capsys):
    code, _, err = run_cli(["analyze", "A fine film.", "--method", "decompx"], capsys)
    assert code == 2
    assert "decompx needs a sequence-classification model" in err and len(err.strip().splitlines()) == 1


def test_cli_unknown_value_bias(capsys):
    code, _, err = run_cli(
        [
            "analyze",
            "A fine film.",
            "--method",
            "decompx_classes",
            "--model-head",
            "sequence-classification",
            "--allow-random-head",
            "--option",
            "decompx_classes.value_bias=zero",
        ],
        capsys,
    )
    assert code == 2
    assert "decompx_classes.value_bias must be one of values, absdot, got 'zero'" in err
    assert len(err.strip().splitlines()) == 1


def test_cli_with_classification_head(capsys):
    code, out, err = run_cli(
        [
            "analyze",
            "A fine film.",
            "--method",
            "decompx_classes",
            "--model-head",
            "sequence-classification",
            "--allow-random-head",
            "--format",
            "json",
        ],
        capsys,
    )
    assert code == 0, err
    m = json.loads(out)["inputs"][0]["methods"]["decompx_classes"]
    assert m["dims"] == ["class", "source"] and len(m["values"]) == 2
