"""Rollouts of the norm maps (N, N-Res, N-ResLN; GlobEnc paper's comparison): equal to the plain product of the
reference decomposition's maps on every family, padding 0, batched == unbatched, and their explain rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mixlens.methods.norms as norms
from mixlens.explain import explain
from mixlens.methods.reference import decompose
from mixlens.methods.registry import refused_by
from mixlens.pipeline import resolve_rows, run_methods, stream_trace
from tests.conftest import SENTENCES, random_lens

ROLLOUTS = {"norm_rollout": "n", "norm_res_rollout": "n_res", "norm_resln_rollout": "n_resln"}


def product(mats: np.ndarray) -> np.ndarray:
    """R_0 = M_0, R_l = M_l R_{l−1}, one input: mats [L, n, n] → [L, n, n] (plain loop, float64)."""
    out, acc = np.zeros_like(mats), np.eye(mats.shape[-1])
    for layer, m in enumerate(mats):
        acc = m @ acc
        out[layer] = acc
    return out


def test_rollouts_equal_the_product_of_the_reference_maps(family_lens):
    tr = family_lens.trace(SENTENCES)
    ref = decompose(tr)
    rollouts = {k: v for k, v in ROLLOUTS.items() if k not in refused_by(family_lens.adapter.family)}
    res = family_lens.analyze(SENTENCES, list(rollouts), batch_size=3)
    single = family_lens.analyze(SENTENCES, list(rollouts), batch_size=1)
    lengths = [len(t) for t in res.tokens]
    assert len(set(lengths)) > 1  # padded batch
    for name, field in rollouts.items():
        v = res[name].values  # [B, L, n, n]
        for b, n in enumerate(lengths):
            want = product(getattr(ref, field)[b, :, :n, :n].double().numpy())
            scale = np.abs(want).max()
            np.testing.assert_allclose(v[b, :, :n, :n], want, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
            assert not v[b, :, n:].any() and not v[b, :, :, n:].any(), name
        np.testing.assert_allclose(v, single[name].values, rtol=1e-4, atol=1e-5 * np.abs(v).max(), err_msg=name)
    if family_lens.adapter.family.causal:
        for name in rollouts:
            assert np.abs(np.triu(res[name].values, k=1)).max() == 0, name


def test_norm_res_rollout_differs_from_norm_rollout(bundled):
    """The residual really enters: N-Res's diagonal is larger than N's, so the products differ."""
    res = bundled.analyze(SENTENCES[:1], ["norm_rollout", "norm_res_rollout"])
    a, b = res["norm_rollout"].input(0)[-1], res["norm_res_rollout"].input(0)[-1]
    assert np.abs(a - b).max() > 0.1 * np.abs(b).max()


ROW_FAMILIES = ["bert", "gpt2", "llama", "mpnet", "gemma3_text", "bloom", "falcon"]  # post-LN, pre-LN LayerNorm and
# RMS, sandwich, ALiBi, parallel multi-query


def _assert_rows_equal(got: torch.Tensor, full: torch.Tensor, rows: torch.Tensor, name: str) -> None:
    """got [B, L, K, n] equals rows [B, K] of full [B, L, n, n] to 1e-6 of each row's largest value (float32)."""
    want = full.gather(2, rows[:, None, :, None].expand(-1, full.shape[1], -1, full.shape[-1]))
    assert got.shape == want.shape, name
    scale = want.abs().amax(-1, keepdim=True)
    err = ((got - want).abs() / torch.where(scale > 0, scale, 1.0)).max()
    assert err <= 1e-6, (name, float(err))
    assert want.abs().amax() > 0, name


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("family", ROW_FAMILIES)
def test_row_mode_equal_the_rows_of_the_full_maps(family, compiled, tokenizer, monkeypatch):
    """Row mode (the rows propagated down the layers from each layer's map rows) equals the full product's rows, on a
    full trace (rows from the engine's token pass) and a streamed one (causal LMs: from q and K, no n × n)."""
    monkeypatch.setattr(norms, "COMPILED", compiled)
    lens = random_lens(family, tokenizer)
    names = [m for m in ROLLOUTS if m not in refused_by(lens.adapter.family)]
    enc = lens.encode(SENTENCES)  # three lengths: a padded batch
    full = run_methods(lens.trace(enc), names).values
    for spec in ("last", [0, -1, 2]):
        streamed = stream_trace(lens.adapter, lens.model, enc.inputs, names, spec, lens.tokenizer)
        assert all(lt.alpha.numel() == 0 for lt in streamed.layers)
        for tr in (lens.trace(enc), streamed):
            rows = resolve_rows(spec, tr.lengths)
            got = run_methods(tr, names, rows=spec).values
            for name in names:
                _assert_rows_equal(got[name], full[name], rows, name)


def test_explain_reads_the_cls_row_of_the_last_layer(tokenizer):
    clf = random_lens("bert", tokenizer, head="AutoModelForSequenceClassification")
    ex = explain(clf, SENTENCES[:2], list(ROLLOUTS))
    res = clf.analyze(SENTENCES[:2], list(ROLLOUTS))
    for b, e in enumerate(ex.inputs):
        for name in ROLLOUTS:
            want = res[name].input(b)[-1, 0]  # [CLS] row of the last layer
            np.testing.assert_allclose(e.scores[name], want, rtol=1e-5, atol=1e-7, err_msg=name)
            assert torch.isfinite(torch.as_tensor(e.scores[name])).all()


def test_target_rows_of_a_deep_model_are_the_full_rows_up_to_one_factor(tokenizer):
    """30 layers: the plain products leave [2⁻⁶⁴, 2⁶⁴], so full mode divides each layer, row mode each row, by a power
    of two (`rollout.in_range`). The streamed rows stay finite with their largest value in range, and each is the full
    map's row times one positive factor (compared where the values are within 2⁻⁶⁰ of the row's largest: N, with no
    residual, spans more than float32 within one row)."""
    lens = random_lens("llama", tokenizer, num_hidden_layers=30)
    names = list(ROLLOUTS)
    enc = lens.encode(SENTENCES[:2])
    full = run_methods(lens.trace(enc), names).values
    tr = stream_trace(lens.adapter, lens.model, enc.inputs, names, [1, -1], lens.tokenizer)
    got = run_methods(tr, names, rows=[1, -1]).values
    rows = resolve_rows([1, -1], tr.lengths)
    for name in names:
        want = full[name].gather(2, rows[:, None, :, None].expand(-1, 30, -1, full[name].shape[-1])).double()
        have = got[name].double()
        assert torch.isfinite(have).all(), name
        top = have.amax(-1)
        assert ((top >= 2.0**-64) & (top <= 2.0**64)).all(), name
        big = want >= 2.0**-60 * want.amax(-1, keepdim=True)
        ratio = torch.where(big, have / torch.where(big, want, 1.0), 0.0)
        one = ratio.amax(-1, keepdim=True)  # the row's factor
        assert (one > 0).all(), name
        torch.testing.assert_close(ratio, torch.where(big, one, 0.0), rtol=1e-5, atol=0, msg=name)
