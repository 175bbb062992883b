"""Families of issue 42 whose layout is another family's with fused or renamed weights: every method gives the same
values on both forms of one network (an independent check of each fused-weight reading: q | k | v, gate | up)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T

import mixlens
from mixlens.methods import get as get_method
from tests.conftest import random_lens

TEXTS = ["The keys to the cabinet are on the table.", "Short one."]
SAME = ["norm", "norm_resln", "alti", "globenc", "alti_logit", "logit_attn", "decompx_logit", "flow_routes_tokens"]
GRADIENTS = [("attnlrp", {}), ("attnlrp", {"variant": "cp"}), ("grad_x_input", {})]


def _phi3_as_llama(phi3: torch.nn.Module) -> torch.nn.Module:
    """The Llama network with Phi-3's weights: qkv_proj split into q, k, v and gate_up_proj into gate, up."""
    c = phi3.config
    cfg = T.LlamaConfig(
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        intermediate_size=c.intermediate_size,
        vocab_size=c.vocab_size,
        pad_token_id=c.pad_token_id,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    llama = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    own = phi3.state_dict()
    state = {}
    q = c.num_attention_heads * c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * c.hidden_size // c.num_attention_heads
    for k, v in own.items():
        if k.endswith("qkv_proj.weight"):
            p = k.replace("qkv_proj.weight", "")
            state[p + "q_proj.weight"], state[p + "k_proj.weight"], state[p + "v_proj.weight"] = v.split([q, kv, kv])
        elif k.endswith("gate_up_proj.weight"):
            p = k.replace("gate_up_proj.weight", "")
            state[p + "gate_proj.weight"], state[p + "up_proj.weight"] = v.chunk(2)
        else:
            state[k] = v
    llama.load_state_dict(state)
    return llama.eval()


@pytest.fixture(scope="module")
def phi3_pair(tokenizer):
    phi3 = random_lens("phi3", tokenizer, head="AutoModelForCausalLM")
    llama = mixlens.Lens(_phi3_as_llama(phi3.model), tokenizer, name="phi3-as-llama")
    with torch.no_grad():
        enc = phi3.encode(TEXTS)
        torch.testing.assert_close(phi3.model(**enc.inputs).logits, llama.model(**enc.inputs).logits)
    return phi3, llama


def test_phi3_fused_projections_read_as_llamas_separate_ones(phi3_pair):
    phi3, llama = phi3_pair
    assert phi3.adapter.family.name == "phi3" and llama.adapter.family.name == "llama"
    a, b = phi3.analyze(TEXTS, SAME), llama.analyze(TEXTS, SAME)
    for name in SAME:
        torch.testing.assert_close(torch.as_tensor(a[name].values), torch.as_tensor(b[name].values), msg=name)
    ta, tb = phi3.trace(TEXTS), llama.trace(TEXTS)
    for name, opts in GRADIENTS:
        got, want = get_method(name)(ta, **opts), get_method(name)(tb, **opts)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=f"{name} {opts}")


def test_olmo2_has_no_norm_after_the_sum(tokenizer):
    """OLMo 2 (h = x + g^post(Attn(x)), no norm after the sum): the sum is captured at the FFN's input and is the
    model's own; the ResLN-N ratio is Res-N (unit norm: γ = 1, no centring, the scale cancels); N-ResLN refuses."""
    lens = random_lens("olmo2", tokenizer)
    seen = []
    hooks = [lay.mix_at.register_forward_hook(lambda m, a, o: seen.append(a[0])) for lay in lens.adapter.layers]
    try:
        res = lens.analyze(TEXTS, ["norm_res"])
    finally:
        for h in hooks:
            h.remove()
    tr = lens.trace(TEXTS)
    for lt, h in zip(tr.layers, seen[-len(tr.layers) :], strict=True):
        assert torch.equal(lt.mix_in, h)
    torch.testing.assert_close(res.mixing_ratio("ResLN-N"), res.mixing_ratio("Res-N"), atol=1e-6, rtol=1e-5)
    both = lens.analyze(TEXTS, ["norm_res", "norm_resln"])  # no norm after the sum: the ResLN map is the identity
    np.testing.assert_allclose(both["norm_resln"].values, both["norm_res"].values, rtol=1e-6, atol=1e-7)
