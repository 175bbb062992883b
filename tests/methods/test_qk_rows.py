"""Traces that keep q and K instead of α (`Method.qk_rows`, `mixlens.rowattn`): the decoder methods that read α only by
rows give the same values and extras as on a trace holding α, on every decoder family (GPT-2, Llama with grouped
keys, Gemma 2 with its attention soft cap and Gemma 3 with sliding windows and sandwich norms), on a padded batch."""

from __future__ import annotations

import pytest
import torch

from mixlens.methods import get as get_method
from mixlens.methods.registry import REGISTRY
from mixlens.pipeline import run_methods
from tests.conftest import SENTENCES, random_lens

DECODERS = ["gpt2", "llama", "gemma2", "gemma3_text", "qwen3", "phi3", "granite", "olmo2", "mixtral", "llama3-rope"]
QK_METHODS = sorted(m for m, spec in REGISTRY.items() if spec.qk_rows)


def test_the_decoder_methods_declare_it():
    assert {"alti_logit", "logit_attn", "flow_routes", "flow_routes_tokens"} <= set(QK_METHODS)


@pytest.mark.parametrize("family", DECODERS)
def test_qk_traces_give_the_values_of_alpha_traces(family, tokenizer):
    lens = random_lens(family, tokenizer, head="AutoModelForCausalLM", seed=3)
    enc = lens.encode(SENTENCES)
    held = lens.trace(enc, ffn=True)
    rows = lens.trace_for(enc, QK_METHODS, output=True)  # what `batches` / explain trace for these methods
    assert all(lt.alpha.numel() == 0 and lt.qk is not None for lt in rows.layers)
    for m in QK_METHODS:
        opts = {"heads": True} if get_method(m).head_dims else {}
        want, got = run_methods(held, [m], **opts), run_methods(rows, [m], **opts)
        scale = float(want.values[m].abs().max()) or 1.0
        torch.testing.assert_close(got.values[m], want.values[m], rtol=1e-4, atol=1e-5 * scale, msg=m)
        for key, v in want.extras[m].items():
            torch.testing.assert_close(got.extras[m][key], v, rtol=1e-4, atol=1e-5 * max(1.0, float(v.abs().max())))


def test_an_encoder_or_another_method_keeps_alpha(tokenizer):
    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM")
    enc = lens.encode(SENTENCES[:1])
    assert lens.trace_for(enc, ["alti_logit", "alti"], output=True).layers[0].alpha.numel() > 0
    bert = random_lens("bert", tokenizer)
    assert bert.trace_for(bert.encode(SENTENCES[:1]), ["flow_routes"]).layers[0].qk is None
