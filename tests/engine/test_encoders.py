"""What the method × family matrix does not reach on ModernBERT and DeBERTa: local windows longer than the input,
mean pooling into the classifier, DeBERTa's other attention layouts, its refused convolution, and the AttnLRP rule
on ModernBERT's fused GLU projection."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T

import mixlens
from mixlens.adapters import resolve
from mixlens.methods.attnlrp import lrp_rules
from tests.conftest import SENTENCES, assert_trace_is_the_models_own, random_lens, random_model
from tests.engine.test_rows import test_rows_equal_the_rows_of_the_full_maps as rows_case
from tests.engine.test_stream import test_streamed_rows_equal_the_rows_of_full_mode as streamed_rows_case
from tests.methods.test_decompx import check_exact

LONG = "The old man who lived by the river walked slowly to the market every morning to buy fresh bread."
METHODS = ["norm_resln", "alti", "globenc", "value_zeroing"]


def test_modernbert_local_layers_see_their_window_and_padding_changes_nothing(tokenizer):
    """Sliding layers attend within ±local_attention/2 of each real token, global ones everywhere; a long input
    batched with short ones (padding inside and beyond the windows) gives the maps of each input alone."""
    lens = random_lens("modernbert", tokenizer)
    texts = [LONG, *SENTENCES]
    tr = lens.trace(texts)
    n = tr.lengths[0]
    far = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() > lens.model.config.sliding_window
    for layer, kind in zip(tr.layers, lens.model.config.layer_types, strict=True):
        alpha = layer.alpha[0, :, :n, :n]
        assert bool((alpha[:, far] == 0).all()) == (kind == "sliding_attention"), kind
    assert lens.adapter.layers[0].ln_in is None and lens.adapter.layers[1].ln_in is not None
    batched = lens.analyze(texts, METHODS)
    assert float(batched.reconstruction_error.max()) < 1e-5
    for b, text in enumerate(texts):
        single = lens.analyze([text], METHODS)
        for name in METHODS:
            np.testing.assert_allclose(batched[name].input(b), single[name].input(0), atol=1e-5, err_msg=name)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("family", ["modernbert", "deberta-v2"])
def test_rows_and_streaming_equal_the_full_maps(family, compiled, tokenizer, monkeypatch):
    """Row mode and its streaming on the first pre-LN encoder (and DeBERTa's own attention route)."""
    rows_case(family, compiled, tokenizer, monkeypatch)
    streamed_rows_case(family, compiled, tokenizer, monkeypatch)


@pytest.mark.parametrize(("head", "want"), [("AutoModel", [0, 0]), ("AutoModelForMaskedLM", [2, 4])])
def test_modernbert_routes_explain_the_mask_or_the_first_token(tokenizer, head, want):
    """Information-flow routes on a pre-LN encoder: by default to a masked LM's [MASK], else to [CLS]."""
    res = random_lens("modernbert", tokenizer, head=head).analyze(
        ["The [MASK] sat.", "A dog ran [MASK]!"], ["flow_routes"]
    )
    assert res["flow_routes"].extras["position"].tolist() == want


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_decompx_carries_through_pooling_and_head(tokenizer, pooling):
    """Class scores sum to the logits through the final norm, [CLS] or mean pooling, dense → GELU → LayerNorm and
    the classifier (all with biases)."""
    lens = random_lens(
        "modernbert", tokenizer, head="AutoModelForSequenceClassification", num_labels=3, classifier_pooling=pooling
    )
    check_exact(lens, [LONG, *SENTENCES])


@pytest.mark.parametrize(
    "overrides",
    [
        dict(share_att_key=False, pos_att_type=["c2p"], position_buckets=-1, max_relative_positions=6),
        dict(share_att_key=False, pos_att_type=["p2c", "c2p"], norm_rel_ebd="none"),
        dict(relative_attention=False, position_biased_input=True, pos_att_type=None),
    ],
    ids=["c2p-unbucketed", "own-position-projections", "absolute-positions"],
)
def test_deberta_attention_layouts_are_exact(tokenizer, overrides):
    """α from content and relative-position terms (separate position projections, no buckets, or none at all): the
    trace is the model's own, the norm maps rebuild every layer and DecompX's class scores sum to the logits."""
    assert_trace_is_the_models_own(random_lens("deberta-v2", tokenizer, **overrides))
    res = random_lens("deberta-v2", tokenizer, **overrides).analyze([LONG, *SENTENCES], METHODS)
    assert float(res.reconstruction_error.max()) < 1e-5
    clf = random_lens("deberta-v2", tokenizer, head="AutoModelForSequenceClassification", num_labels=2, **overrides)
    check_exact(clf, [LONG, *SENTENCES])


@pytest.mark.parametrize(("key", "value", "words"), [("conv_kernel_size", 3, "convolution"), ("z_steps", 2, "z_steps")])
def test_deberta_mixing_outside_attention_is_refused_in_one_line(tokenizer, key, value, words):
    model = random_model("deberta-v2", tokenizer)
    model.config.__dict__[key] = value  # as a checkpoint's config would say
    with pytest.raises(mixlens.MixlensError) as e:
        resolve(model)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_modernbert_fused_glu_gets_the_uniform_rule(tokenizer):
    """AttnLRP on act(gate) ⊙ up computed by one projection Wi = [gate | up]: the gradient of each factor halved (the
    gate through the identity rule of its activation), as for two separate projections."""
    lens = random_lens("modernbert", tokenizer)
    mlp = lens.model.layers[1].mlp
    x = torch.randn(2, 5, 64, requires_grad=True)
    with lrp_rules(lens.adapter, lens.model):
        (got,) = torch.autograd.grad(mlp(x).sum(), x)
    half = mlp.Wo.in_features
    w, b = mlp.Wi.weight, mlp.Wi.bias
    gate = x @ w[:half].T + b[:half]
    up = x @ w[half:].T + b[half:]
    act = mlp.act(gate)
    theta = (act / (gate + 1e-10)).detach()
    surrogate = mlp.Wo(0.5 * theta * gate * up.detach() + 0.5 * act.detach() * up)
    (want,) = torch.autograd.grad(surrogate.sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_real_modernbert_and_deberta_layouts_load(tokenizer):
    """The published configurations' layouts (ModernBERT-base's three-layer pattern, DeBERTa-v3's attention) resolve
    to the adapter, at a small width."""
    for cfg in (
        T.ModernBertConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=48),
        T.DebertaV2Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=48,
            relative_attention=True,
            pos_att_type="p2c|c2p",
            position_buckets=256,
            norm_rel_ebd="layer_norm",
            share_att_key=True,
            position_biased_input=False,
        ),
    ):
        cfg.vocab_size, cfg.pad_token_id = tokenizer.vocab_size, tokenizer.pad_token_id
        model = T.AutoModel.from_config(cfg, attn_implementation="eager")
        res = mixlens.Lens(model, tokenizer, name="layout").analyze(SENTENCES, ["norm_resln"])
        assert float(res.reconstruction_error.max()) < 1e-5
