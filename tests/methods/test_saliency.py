"""Saliency, gradient × input and integrated gradients: hand-computable gradients, completeness, batching."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import mixlens
from mixlens.cli import main
from mixlens.errors import MixlensError
from mixlens.methods.saliency import output_attribution
from tests.conftest import random_lens, random_model

TEXTS = ["A dog barked.", "Short one, a bit longer."]


@pytest.fixture(scope="module")
def linear_gpt2(tokenizer) -> mixlens.Lens:
    """GPT-2 with every block's weights zeroed and no final LN: h_i = wte(x_i) + wpe(i) exactly."""
    model = random_model("gpt2", tokenizer, n_embd=32)
    with torch.no_grad():
        for block in model.h:
            for lin in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                lin.weight.zero_()
                lin.bias.zero_()
    model.ln_f = nn.Identity()
    return mixlens.Lens(model, tokenizer, name="linear-gpt2")


def test_hand_computable_gradient(linear_gpt2):
    """f = Σ_i (w·h_i)², so ∂f/∂e_j = 2 (w·h_j) w; IG from a zero baseline integrates it exactly."""
    w = torch.randn(32, generator=torch.Generator().manual_seed(0))

    def target(out, inputs):
        s = (out.last_hidden_state @ w) * inputs["attention_mask"]
        return s.pow(2).sum(-1)

    tr = linear_gpt2.trace(TEXTS)
    m = linear_gpt2.model
    e = m.wte(tr.inputs["input_ids"])
    h = e + m.wpe(torch.arange(e.shape[1]))[None] + m.wte(tr.inputs["token_type_ids"])  # GPT-2 embeds types with wte
    mask = tr.mask.float()
    grad = 2 * (h @ w)[..., None] * w * mask[..., None]
    sal = output_attribution(tr, "saliency", target=target, reduction="sum")
    torch.testing.assert_close(sal.raw, grad)
    torch.testing.assert_close(sal.values, grad.sum(-1))
    l2 = output_attribution(tr, "saliency", target=target).values
    torch.testing.assert_close(l2, grad.norm(dim=-1))
    gxi = output_attribution(tr, "grad_x_input", target=target, reduction="l1").values
    torch.testing.assert_close(gxi, (grad * e).abs().sum(-1))
    # along the path a·e (+ positions): f(a) = Σ_i (a w·e_i + w·p_i)², ∂/∂e_j integrates to
    # ∫ 2 (a w·e_j + w·p_j) w ⊙ e_j da = (w·e_j + 2 w·p_j) w ⊙ e_j
    p = h - e
    ig = output_attribution(tr, "integrated_gradients", target=target, reduction="sum", steps=64)
    expected = ((e @ w) + 2 * (p @ w))[..., None] * w * e * mask[..., None]
    torch.testing.assert_close(ig.raw, expected, rtol=1e-4, atol=1e-4)
    assert ig.delta.abs().max() < 1e-3


def test_classifier_ig_completeness_and_batching(tokenizer):
    lens = mixlens.Lens(
        random_model(
            "bert", tokenizer, head="AutoModelForSequenceClassification", hidden_size=32, intermediate_size=64
        ),
        tokenizer,
    )
    tr = lens.trace(TEXTS)
    for baseline in ("zero", "pad"):
        ig = output_attribution(tr, "integrated_gradients", target=1, reduction="sum", baseline=baseline, steps=100)
        gap = ig.target_value - ig.baseline_value
        assert gap.abs().min() > 1e-3
        torch.testing.assert_close(ig.values.sum(-1), gap, atol=2e-3 + 0.02 * float(gap.abs().max()), rtol=0)
        torch.testing.assert_close(ig.delta, ig.values.sum(-1) - gap, atol=1e-5, rtol=1e-4)
    both = output_attribution(tr, "grad_x_input")
    torch.testing.assert_close(both.target_value, tr.logits.max(-1).values)  # target 'pred' = argmax class
    for b, text in enumerate(TEXTS):
        one = output_attribution(lens.trace([text]), "grad_x_input")
        n = one.values.shape[-1]
        torch.testing.assert_close(both.values[b, :n], one.values[0], atol=1e-5, rtol=1e-4)
        assert both.values[b, n:].abs().sum() == 0


def test_masked_lm_target_at_mask(tokenizer):
    lens = mixlens.Lens(
        random_model("bert", tokenizer, head="AutoModelForMaskedLM", hidden_size=32, intermediate_size=64), tokenizer
    )
    texts = ["The [MASK] barked.", "A cat [MASK] on the mat today."]
    tr = lens.trace(texts)
    tok_id = tokenizer.convert_tokens_to_ids("dog")
    res = output_attribution(tr, "saliency", target=tok_id)
    pos = (tr.inputs["input_ids"] == tokenizer.mask_token_id).int().argmax(-1)
    torch.testing.assert_close(res.target_value, tr.logits[torch.arange(2), pos, tok_id])
    assert res.values.shape == tr.mask.shape and (res.values[tr.mask] > 0).all()
    with pytest.raises(MixlensError, match="no \\[MASK\\]"):
        output_attribution(lens.trace(["no mask here"]), "saliency")
    an = lens.analyze(texts, ["saliency", "integrated_gradients"], options={"integrated_gradients": {"steps": 8}})
    assert an["saliency"].dims == ("source",)
    torch.testing.assert_close(torch.from_numpy(an["saliency"].values), output_attribution(tr, "saliency").values)


def test_cli_errors(tmp_path, capsys):
    for argv, msg in (
        (["--option", "saliency.reduction=max"], "saliency.reduction must be one of l2, l1, sum"),
        (["--option", "saliency.target=cls"], "saliency.target must be an integer ≥ 0 or 'pred'"),
        (["--option", "saliency.target=3"], "sentence encoder has one target"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["analyze", "hi there", "--method", "saliency", "-o", str(tmp_path / "x.json"), *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err


def test_ig_chunked_equals_unchunked(tokenizer):
    """Integrated gradients in chunks of input × step rows give the numbers of one pass over all steps."""
    lens = mixlens.Lens(
        random_model(
            "bert", tokenizer, head="AutoModelForSequenceClassification", hidden_size=32, intermediate_size=64
        ),
        tokenizer,
    )
    tr = lens.trace(TEXTS)
    whole = output_attribution(
        tr, "integrated_gradients", target=1, reduction="sum", steps=20, internal_batch_size=2 * 20
    )
    for rows in (2, 7, 16):  # one step per chunk, uneven chunks, several steps per chunk
        part = output_attribution(
            tr, "integrated_gradients", target=1, reduction="sum", steps=20, internal_batch_size=rows
        )
        torch.testing.assert_close(part.raw, whole.raw, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(part.delta, whole.delta, atol=1e-6, rtol=1e-5)
    default = output_attribution(tr, "integrated_gradients", target=1, reduction="sum", steps=20)
    torch.testing.assert_close(default.raw, whole.raw, atol=1e-6, rtol=1e-5)
    with pytest.raises(MixlensError, match="internal_batch_size"):
        output_attribution(tr, "integrated_gradients", internal_batch_size=0)


def test_output_saliency_runs_no_captured_forward(tokenizer, monkeypatch):
    """Gradient-only runs skip the traced forward (capture hooks): same numbers as from a full trace."""
    lens = mixlens.Lens(
        random_model(
            "bert", tokenizer, head="AutoModelForSequenceClassification", hidden_size=32, intermediate_size=64
        ),
        tokenizer,
    )
    traced = {k: output_attribution(lens.trace(TEXTS), k).values for k in ("saliency", "grad_x_input")}

    def no_trace(*args, **kwargs):
        raise AssertionError("a traced forward pass ran")

    monkeypatch.setattr("mixlens.lens.run_traced", no_trace)
    an = lens.analyze(
        TEXTS, ["saliency", "grad_x_input", "integrated_gradients"], options={"integrated_gradients": {"steps": 4}}
    )
    for k, v in traced.items():
        for b in range(len(TEXTS)):
            n = len(an.tokens[b])
            torch.testing.assert_close(torch.from_numpy(an[k].values[b, :n]), v[b, :n])


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_lm_logits_only_at_target(tokenizer, family, per_row, monkeypatch):
    """A causal LM's target logit is computed at its position only (`logits_to_keep`: one row per input, or the
    batch's positions where the model code takes only a 1-D one), with the numbers of the full-logit model:
    plain autograd and captum's IntegratedGradients on f(e) = logits[b, position, token] of all positions."""
    from captum.attr import IntegratedGradients

    lens = random_lens(family, tokenizer, head="AutoModelForCausalLM")
    if not per_row:
        monkeypatch.setattr("mixlens.methods.saliency.per_row_keep", lambda model: False)
    tr = lens.trace(["A dog barked.", "Short one, a bit longer.", "A cat."])  # three lengths, right padding
    b = tr.mask.shape[0]
    others = {k: v for k, v in tr.inputs.items() if k != "input_ids"}
    e = lens.model.get_input_embeddings()(tr.inputs["input_ids"]).detach()

    def f(emb, at, tok, *more):  # the full-logit model's target logit
        out = lens.model(inputs_embeds=emb, **dict(zip(others, more, strict=True)))
        return out.logits[torch.arange(len(at)), at, tok]

    rows_in: list[tuple[int, ...]] = []
    head = lens.model.get_output_embeddings().register_forward_hook(lambda m, a, o: rows_in.append(a[0].shape))
    try:
        for target, position, at in (("pred", None, tr.mask.sum(-1) - 1), (7, 2, torch.full((b,), 2))):
            rows_in.clear()
            res = output_attribution(tr, "grad_x_input", target=target, position=position)
            assert rows_in == [(b, 1 if per_row else len(set(at.tolist())), 64)]  # not [b, n, d]
            x = e.clone().requires_grad_(True)
            full = lens.model(inputs_embeds=x, **others).logits[torch.arange(b), at]  # [B, vocab]
            tok = full.argmax(-1) if target == "pred" else torch.full((b,), target)
            value = full[torch.arange(b), tok]
            (grad,) = torch.autograd.grad(value.sum(), x)
            torch.testing.assert_close(res.target_value, value.detach())
            torch.testing.assert_close(res.raw, grad * e)

            ig = output_attribution(tr, "integrated_gradients", target=target, position=position, steps=8)
            extra = (at, tok, *others.values())
            ref, delta = IntegratedGradients(f).attribute(
                e, additional_forward_args=extra, n_steps=8, return_convergence_delta=True
            )
            torch.testing.assert_close(ig.raw, ref)
            torch.testing.assert_close(ig.delta, delta, atol=1e-5, rtol=1e-4)
    finally:
        head.remove()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_recomputed_layers_give_the_kept_gradients(family, tokenizer, monkeypatch):
    """Saliency, gradient × input, integrated gradients and the per-request row gradients with each layer recomputed
    in the backward (the default) equal the pass that keeps every layer's activations, to 1e-6 of the largest
    (float32), on a padded batch of a causal LM."""
    from mixlens.methods import saliency
    from mixlens.targets import Request

    lens = random_lens(family, tokenizer, head="AutoModelForCausalLM")
    got: dict[bool, list[torch.Tensor]] = {}
    for recompute in (False, True):
        monkeypatch.setattr(saliency, "RECOMPUTE_LAYERS", recompute)
        tr = lens.trace(lens.encode(TEXTS))  # a fresh memo: nothing shared between the two
        out = [output_attribution(tr, kind, reduction="sum").raw for kind in saliency.KINDS[:2]]
        out.append(output_attribution(tr, "integrated_gradients", steps=4).raw)
        one = lens.trace(lens.encode(TEXTS[:1]))
        reqs = [Request((t,), (-1,), (p,)) for t, p in ((5, 2), (7, 3))]
        out += [g for g, _, _ in saliency.row_gradients(one, reqs)] if not recompute else []
        if recompute:
            with saliency.recomputed():
                out += [g for g, _, _ in saliency.row_gradients(one, reqs)]
        got[recompute] = out
    for a, b in zip(got[False], got[True], strict=True):
        scale = float(a.abs().max())
        assert scale > 0
        assert float((b - a).abs().max()) / scale < 1e-6


def test_recomputed_gradient_pass_keeps_no_layer_activations(tokenizer, monkeypatch):
    """The plain gradient pass (saliency, gradient × input, evaluate's agreement reference) saves each layer's input
    and nothing more of it for its backward (4 layers save two [B, n, d] more than 2); keeping every layer's
    activations saves dozens of tensors a layer (its FFN's [B, n, d_ff] among them)."""
    from mixlens.methods import saliency

    saved: dict[tuple[bool, int], list[tuple[int, ...]]] = {}
    for layers in (2, 4):
        lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM", num_hidden_layers=layers)
        for recompute in (False, True):
            monkeypatch.setattr(saliency, "RECOMPUTE_LAYERS", recompute)
            tr = lens.trace(lens.encode(TEXTS))
            shapes: list[tuple[int, ...]] = []

            def pack(t: torch.Tensor, shapes: list = shapes) -> torch.Tensor:
                shapes.append(tuple(t.shape))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                output_attribution(tr, "saliency")
            saved[recompute, layers] = shapes
    d_ff = lens.model.config.intermediate_size
    assert any(s[-1:] == (d_ff,) for s in saved[False, 2])
    assert not any(s[-1:] == (d_ff,) for s in saved[True, 2] + saved[True, 4])
    more = {k: Counter(saved[k, 4]) - Counter(saved[k, 2]) for k in (False, True)}
    assert more[False].total() > 10 * 2
    b, n = tr.mask.shape
    assert more[True] == Counter({(b, n, lens.model.config.hidden_size): 2})
