"""The block variants one `model_type` covers (`Family.layout`, docs/DESIGN.md §3.6 "Parallel blocks, ALiBi, learned
positions"): each runs every method or refuses it as the registry declares, its trace is the model's own, and a
variant outside the math refuses in one line before any method runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mixlens
from mixlens.errors import MixlensError
from mixlens.methods import REGISTRY
from tests.conftest import SENTENCES, assert_trace_is_the_models_own, random_lens, random_model
from tests.methods.test_capabilities import CHEAP, TEXTS, expected_refusal

VARIANTS = {  # name → (conftest family, config overrides, whether the block is parallel)
    "opt-post-ln": ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=32), False),  # opt-350m's layout
    "opt-projected": ("opt", dict(word_embed_proj_dim=32), False),  # pre-LN with project_in / project_out
    "gpt_neox-sequential": ("gpt_neox", dict(use_parallel_residual=False), False),
    "falcon-sequential": ("falcon", dict(parallel_attn=False), False),
    "falcon-multi-head": ("falcon", dict(multi_query=False), True),
    "falcon-new-architecture": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2), True),  # 2 norms
    "falcon-new-one-norm": (
        "falcon",
        dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
        True,
    ),  # noqa: E501
    "falcon-alibi": ("falcon", dict(alibi=True), True),
}


@pytest.mark.parametrize("head", ["AutoModelForCausalLM", "AutoModelForSequenceClassification"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_method_runs_or_refuses_as_declared(variant, head, tokenizer):
    family, overrides, parallel = VARIANTS[variant]
    extra = {"num_labels": 2} if "Classification" in head else {}
    lens = random_lens(family, tokenizer, head=head, **overrides, **extra)
    assert lens.adapter.family.parallel is parallel
    for name in REGISTRY:
        want = expected_refusal(name, lens)
        options = {name: CHEAP[name]} if name in CHEAP else None
        if want is not None:
            with pytest.raises(MixlensError) as e:
                lens.analyze(TEXTS, [name], options=options)
            assert want in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
            continue
        res = lens.analyze(TEXTS, [name], options=options)  # the methods' exactness checks raise on a miss
        assert np.isfinite(res[name].values).all(), name
        if res.reconstruction_error is not None:
            assert float(res.reconstruction_error.max()) < 1e-4, name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trace_is_the_models_own(variant, tokenizer):
    family, overrides, _ = VARIANTS[variant]
    assert_trace_is_the_models_own(random_lens(family, tokenizer, **overrides))


def test_refusals_of_each_layout(tokenizer):
    """What a layout's math does not cover is declared: a parallel block has no stream after attention for the flow
    routes' FFN node; a post-LN decoder's stream is not a sum of updates for ALTI-Logit."""
    neox = random_lens("gpt_neox", tokenizer, head="AutoModelForCausalLM")
    with pytest.raises(MixlensError, match="does not support the gpt_neox family: .*parallel block"):
        neox.analyze(TEXTS, ["flow_routes"])
    post = random_lens("opt", tokenizer, head="AutoModelForCausalLM", do_layer_norm_before=False)
    with pytest.raises(MixlensError, match="does not support the opt family: .*post-LN decoder"):
        post.analyze(TEXTS, ["alti_logit"])


def test_parallel_block_attention_sum_and_identity_norm(tokenizer):
    """In a parallel block the trace's `mix_in` is x + attention output (the block never forms it) and `mix_out` the
    same (no norm follows), so the layer output minus `mix_in` is the FFN's own output, and N-ResLN = N-Res."""
    lens = random_lens("gpt_neox", tokenizer)
    tr = lens.trace(SENTENCES, ffn="update")
    for lt in tr.layers:
        torch.testing.assert_close(lt.mix_in, lt.x + lt.attn_out, rtol=0, atol=0)
        assert torch.equal(lt.mix_out, lt.mix_in)
        assert lt.out is not None and lt.ffn_update is not None
        torch.testing.assert_close(lt.out - lt.mix_in, lt.ffn_update, rtol=1e-5, atol=1e-6)
    res = lens.analyze(SENTENCES, ["norm_res", "norm_resln"])
    np.testing.assert_allclose(res["norm_resln"].values, res["norm_res"].values, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["gpt_neox", "falcon", "bloom"])
def test_the_check_is_live(tokenizer, family, monkeypatch):
    """Where the trace forms the attention residual sum itself (parallel blocks) the checks still compare with the
    model's real outputs: value vectors changed after the forward pass fail the norm engine's and ALTI-Logit's;
    a wrong W_V (what DecompX propagates through) fails DecompX's."""
    from mixlens.errors import ReconstructionError
    from mixlens.methods import get as get_method

    lens = random_lens(family, tokenizer, head="AutoModelForCausalLM")
    for name in ("norm_res", "alti_logit"):
        tr = lens.trace(lens.encode(SENTENCES[:1]), ffn=True)
        tr.layers[1].value.add_(0.1)
        with pytest.raises(ReconstructionError, match="differ"):
            get_method(name)(tr)
    tr = lens.trace(lens.encode(SENTENCES[:1]), ffn=True)
    lay = lens.adapter.layers[1]
    monkeypatch.setattr(lay, "raw_w_v", -lay.raw_w_v)
    with pytest.raises(ReconstructionError, match="differ"):
        get_method("decompx_logit")(tr)


@pytest.mark.parametrize(
    ("family", "overrides", "why"),
    [
        ("opt", dict(layer_norm_elementwise_affine=False), "layer_norm_elementwise_affine=False"),
        ("bloom", dict(apply_residual_connection_post_layernorm=True), "apply_residual_connection_post_layernorm"),
        ("bloom", dict(pretraining_tp=2, slow_but_exact=True), "slow_but_exact"),
    ],
)
def test_unsupported_layout_refuses_in_one_line(tokenizer, family, overrides, why):
    model = random_model(family, tokenizer, **overrides)
    with pytest.raises(MixlensError, match=why) as e:
        mixlens.Lens(model, tokenizer)
    assert "\n" not in str(e.value)


def test_unsupported_layout_refuses_before_loading(tokenizer, tmp_path, capsys):
    """`mixlens.load` and the CLI refuse such a checkpoint from its config, in one line (exit 2)."""
    from tests.conftest import run_cli

    model = random_model("bloom", tokenizer, apply_residual_connection_post_layernorm=True)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(MixlensError, match="apply_residual_connection_post_layernorm"):
        mixlens.load(str(tmp_path))
    capsys.readouterr()  # the save's progress bar
    rc, _, err = run_cli(["analyze", SENTENCES[0], "--model", str(tmp_path), "--method", "norm"], capsys)
    assert rc == 2 and "apply_residual_connection_post_layernorm" in err and len(err.strip().splitlines()) == 1
