"""The package reference of the norm decomposition (`methods.reference`) against the model's own modules.

The engine is tested against the reference (tests/engine/test_core.py); here the reference is tested against what the
model's own norm and output-projection modules computed, captured by plain forward hooks (not the trace's), so that
the two cannot be wrong in the same way.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixlens
from mixlens.methods.norms import RATIO_VARIANTS, head_vectors
from mixlens.methods.reference import decompose, mixing_ratio
from tests.conftest import SENTENCES


def module_io(lens: mixlens.Lens, *module_of) -> tuple[mixlens.trace.Trace, list[list[tuple[torch.Tensor, ...]]]]:
    """A trace of SENTENCES and, for each `module_of(layer)` given and each layer, the (input, output) of that
    module, recorded by our own forward hooks in call order (ALBERT calls one shared module once per layer)."""
    lens.trace(SENTENCES[:1])  # a first trace may check the in-place attention against the family's own (more calls)
    calls: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in module_of]
    handles = []
    for record, get in zip(calls, module_of, strict=True):

        def hook(_: nn.Module, args: tuple, out: torch.Tensor, record: list = record) -> None:
            record.append((args[0].detach().clone(), out.detach().clone()))

        modules = {id(m): m for m in (get(lay) for lay in lens.adapter.layers)}
        handles += [m.register_forward_hook(hook) for m in modules.values()]
    try:
        tr = lens.trace(SENTENCES)
    finally:
        for h in handles:
            h.remove()
    assert all(len(c) == lens.adapter.n_layers for c in calls)
    return tr, calls


def test_reference_rebuilds_the_models_own_outputs(family_lens):
    """Σ_j t_ij + b_O is the norm's real input, Σ_j g_i(t_ij) + g_i(b_O) + β its real output, Σ_j u_ij + b_O the
    output projection's real output (times Granite's residual multiplier); f from W_V equals f from the captured
    value vectors."""
    tr, (norm_io, proj_io) = module_io(family_lens, lambda lay: lay.ln_mix.module, lambda lay: lay.o_proj)
    ref = decompose(tr)
    m = tr.mask
    close = dict(atol=1e-4, rtol=1e-4)
    for layer, ((norm_in, norm_out), (_, attn_out)) in enumerate(zip(norm_io, proj_io, strict=True)):
        lay = family_lens.adapter.layers[layer]
        norm_in, norm_out = (t.view(*m.shape, -1) for t in (norm_in, norm_out))  # OPT's FFN block runs on [B·n, d]
        torch.testing.assert_close(ref.y[:, layer][m], norm_in[m], **close)
        torch.testing.assert_close(ref.norm_out[:, layer][m], norm_out[m], **close)
        b_o = lay.b_o if lay.b_o is not None else 0
        want = attn_out[m] * lay.branch_scale  # as it enters the residual stream (Granite's residual multiplier)
        torch.testing.assert_close(ref.u[:, layer].sum(2)[m] + b_o, want, **close)
        f = head_vectors(tr.layers[layer], lay) * m[:, None, :, None]
        torch.testing.assert_close(ref.f[:, layer], f, **close)
    assert ref.error.max() <= 1e-4


def test_reference_on_the_bundled_model(bundled):
    tr, (norm_io,) = module_io(bundled, lambda lay: lay.ln_mix.module)
    ref = decompose(tr)
    for layer, (_, norm_out) in enumerate(norm_io):
        torch.testing.assert_close(ref.norm_out[:, layer][tr.mask], norm_out[tr.mask], atol=1e-4, rtol=1e-4)
    assert ref.n.shape == (3, 6, tr.mask.shape[1], tr.mask.shape[1]) and ref.n_head.shape[2] == 12
    assert set(ref.ratio) == set(RATIO_VARIANTS)


def test_reference_error_sees_a_wrong_weight(bundled, monkeypatch):
    """The reconstruction check is not vacuous: a 1 % change of one layer's W_V shows in that layer only."""
    tr = bundled.trace(SENTENCES[:1])
    assert decompose(tr).error.max() <= 1e-4
    lay = bundled.adapter.layers[2]
    monkeypatch.setattr(lay, "raw_w_v", lay.raw_w_v * 1.01)
    err = decompose(tr).error[0]
    assert err[2] > 1e-3 and err[[0, 1, 3, 4, 5]].max() <= 1e-4


def test_batched_equals_unbatched_and_padding_is_zero(family_lens):
    batched = decompose(family_lens.trace(SENTENCES))
    short = decompose(family_lens.trace(SENTENCES[2:]))
    k = short.n.shape[-1]
    assert batched.n.shape[-1] > k  # the batch is padded
    for key in ("n", "n_res", "n_resln", "s"):
        b = getattr(batched, key)[2]
        torch.testing.assert_close(
            b[..., :k, :k] if b.dim() == 3 else b[..., :k], getattr(short, key)[0], atol=1e-5, rtol=1e-5
        )
        assert not torch.any(b[..., k:]), key
    for v in RATIO_VARIANTS:
        torch.testing.assert_close(batched.ratio[v][2, :, :k], short.ratio[v][0], atol=1e-5, rtol=1e-5)
        assert not torch.any(batched.ratio[v][2, :, k:])


def test_mixing_ratio_is_a_norm_of_summed_vectors():
    """r_i = ‖Σ_{j≠i} v_ij‖ / (‖Σ_{j≠i} v_ij‖ + ‖v_ii‖), by hand: contexts that cancel give 0."""
    v = torch.zeros(1, 3, 3, 2)  # [B, target, source, d]
    v[0, 0, 0] = torch.tensor([1.0, 0.0])  # own vector of target 0
    v[0, 0, 1] = torch.tensor([0.0, 3.0])
    v[0, 0, 2] = torch.tensor([0.0, 1.0])  # context of target 0 sums to (0, 4): r = 4 / 5
    v[0, 1, 1] = torch.tensor([2.0, 0.0])
    v[0, 1, 0] = torch.tensor([5.0, 5.0])
    v[0, 1, 2] = torch.tensor([-5.0, -5.0])  # context of target 1 cancels: r = 0
    v[0, 2, 0] = torch.tensor([3.0, 4.0])  # target 2 has no own vector: r = 1
    r = mixing_ratio(v)[0]
    assert r.tolist() == pytest.approx([0.8, 0.0, 1.0])
