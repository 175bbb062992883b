"""DecompX: class scores sum to the real logits on every family, per-layer parts sum to the real layer
outputs, the AbsDot bias rule by hand, batched == unbatched, and errors through the real CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import mixlens
from mixlens.methods import decompx as dx
from tests.conftest import FAMILIES, SENTENCES, random_lens, run_cli

HEAD = "AutoModelForSequenceClassification"


def check_exact(lens: mixlens.Lens, texts: list[str]) -> None:
    tr = lens.trace(texts, ffn=True)
    for b, n in enumerate(tr.lengths):
        dec = dx.decompose(tr, b)
        logits = tr.logits[b].float()
        rel = (dec.classes.sum(-1) - logits).abs().max() / logits.abs().max()
        assert rel < 1e-3, rel
        assert dec.error == pytest.approx(rel.item(), abs=1e-6)
        for layer, lt in enumerate(tr.layers):  # every layer's parts sum to the real layer output
            real = lt.out[b, :n].float()
            assert (dec.sums[layer] - real).abs().max() < 1e-4 * max(1.0, real.abs().max().item()), layer
        np.testing.assert_allclose(dec.layers.numpy(), dx.decompx(tr)[b, :, :n, :n].numpy(), rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_sum_to_logits_every_family(family, tokenizer):
    lens = random_lens(family, tokenizer, head=HEAD, num_labels=3)
    if "decompx" in lens.adapter.family.refuses:
        pytest.skip("DecompX refuses this family (tested in test_real_models.py)")
    check_exact(lens, SENTENCES)


@pytest.fixture(scope="module")
def classifier() -> mixlens.Lens:
    torch.manual_seed(0)  # the classification head is randomly initialised
    return mixlens.load(head="sequence-classification")


def test_scores_sum_to_logits_bundled(classifier):
    check_exact(classifier, SENTENCES)


def test_batched_equals_unbatched(classifier):
    batched = classifier.analyze(SENTENCES, ["decompx", "decompx_classes"], batch_size=3)
    single = classifier.analyze(SENTENCES, ["decompx", "decompx_classes"], batch_size=1)
    for name in ("decompx", "decompx_classes"):
        np.testing.assert_allclose(batched[name].values, single[name].values, atol=1e-5, rtol=1e-4)
    cls = batched["decompx_classes"]
    assert cls.dims == ("class", "source") and cls.values.shape[:2] == (3, 2)
    n = [len(t) for t in batched.tokens]
    assert all(np.abs(cls.values[b, :, n[b]:]).max(initial=0) == 0 for b in range(3))  # padding is 0


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
    lens = random_lens("bert", tokenizer, head=HEAD, hidden_size=8, num_attention_heads=2, intermediate_size=16,
                       num_hidden_layers=1)
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


def test_cli_with_classification_head(capsys):
    code, out, err = run_cli(["analyze", "A fine film.", "--method", "decompx_classes", "--head",
                          "sequence-classification", "--format", "json"], capsys)
    assert code == 0, err
    m = json.loads(out)["inputs"][0]["methods"]["decompx_classes"]
    assert m["dims"] == ["class", "source"] and len(m["values"]) == 2
