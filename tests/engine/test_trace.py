"""The trace's in-place attention (`mixlens.inplace`) against each family's own attention code."""

from __future__ import annotations

import sys

import pytest
import torch

from mixlens import inplace
from mixlens.adapters import resolve
from tests.conftest import FAMILIES, assert_trace_is_the_models_own, family_of, random_model

EAGER = [f for f in FAMILIES if family_of(f).inplace_attention and family_of(f).probs is None]


def _inputs(model: torch.nn.Module, masked: bool, b: int = 2, n: int = 9):
    cfg = model.config
    heads = cfg.num_attention_heads if hasattr(cfg, "num_attention_heads") else cfg.n_heads
    kv = getattr(cfg, "num_key_value_heads", heads)
    d_h = getattr(cfg, "head_dim", None) or 16
    g = torch.Generator().manual_seed(1)
    query = torch.randn(b, n, heads, d_h, generator=g).transpose(1, 2)  # strided, as the projections leave it
    key, value = (torch.randn(b, n, kv, d_h, generator=g).transpose(1, 2) for _ in range(2))
    mask = None
    if masked:  # padding of the second input and a causal part, as the models' additive masks
        allowed = torch.ones(b, 1, n, n, dtype=torch.bool).tril()
        allowed[1, ..., 6:] = False
        mask = torch.zeros(b, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    kwargs = {"scaling": 0.3, "dropout": 0.0}
    if getattr(cfg, "attn_logit_softcapping", None):
        kwargs["softcap"] = cfg.attn_logit_softcapping
    return query, key, value, mask, kwargs


@pytest.mark.parametrize("family", EAGER)
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_attention_gives_the_familys_eager_floats_and_is_chosen(tokenizer, family, masked):
    model = random_model(family, tokenizer).eval()
    attn = resolve(model).layers[0].attn
    eager = sys.modules[type(attn).__module__].eager_attention_forward
    query, key, value, mask, kwargs = _inputs(model, masked)
    want_z, want_alpha = eager(attn, query, key, value, mask, **kwargs)
    z, alpha = inplace.softmax_attention(attn, query, key, value, mask, **kwargs)
    assert torch.equal(alpha, want_alpha) and torch.equal(z, want_z)
    with torch.no_grad():
        assert inplace.eager_for(eager, attn, query, key, mask, kwargs) is inplace.softmax_attention
    assert inplace.eager_for(eager, attn, query, key, mask, kwargs) is eager  # autograd: the family's own


def test_a_function_with_other_floats_is_not_replaced(tokenizer):
    model = random_model("bert", tokenizer).eval()
    attn = resolve(model).layers[0].attn
    eager = sys.modules[type(attn).__module__].eager_attention_forward

    def nudged(*args, **kwargs):  # the same attention but for one float in a million
        z, alpha = eager(*args, **kwargs)
        return z * (1 + 1e-6), alpha

    query, key, value, mask, kwargs = _inputs(model, True)
    with torch.no_grad():
        assert inplace.eager_for(nudged, attn, query, key, mask, kwargs) is nudged


def test_mpnet_forward_gives_the_modules_floats(tokenizer):
    model = random_model("mpnet", tokenizer).eval()
    attn = resolve(model).layers[0].attn
    g = torch.Generator().manual_seed(2)
    x, bias = torch.randn(2, 7, 64, generator=g), torch.randn(2, 4, 7, 7, generator=g)
    mask = torch.zeros(2, 1, 1, 7)
    mask[1, ..., 5:] = torch.finfo(torch.float32).min
    with torch.no_grad():
        fast = inplace.forward_for(attn)
        assert fast is not None
        got, want = fast(x, mask, bias, output_attentions=True), attn(x, mask, bias, output_attentions=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert inplace.forward_for(attn) is None  # autograd on: the module's own forward


def test_trace_records_the_models_own_attention_and_output_exactly(family_lens):
    assert_trace_is_the_models_own(family_lens)


def test_trace_of_the_bundled_model_is_its_own_forward(bundled):
    assert_trace_is_the_models_own(bundled)


def test_calls_under_forward_mode_autograd_or_vmap_may_not_write_in_place(tokenizer):
    attn = resolve(random_model("bert", tokenizer).eval()).layers[0].attn
    x = torch.ones(3, 4)
    with torch.no_grad():
        assert inplace.may_write_in_place(attn, x)
        verdicts = torch.func.vmap(lambda row: torch.tensor(inplace.may_write_in_place(attn, row)))(x)
        assert verdicts.tolist() == [False] * 3
        with torch.autograd.forward_ad.dual_level():
            assert not inplace.may_write_in_place(attn, torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)))
    assert not inplace.may_write_in_place(attn, x)  # reverse-mode autograd on
