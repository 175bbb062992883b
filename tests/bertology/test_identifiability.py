"""Token identifiability: hidden states line up with the model, nearest neighbour, probes, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mixlens.bertology.identifiability import fit_linear, fit_mlp, hidden_states, identifiability, identified
from mixlens.errors import MixlensError
from tests.conftest import SENTENCES


def test_hidden_states_are_the_models(bundled):
    states = hidden_states(bundled, SENTENCES)
    enc = bundled.encode(SENTENCES)
    with torch.no_grad():
        out = bundled.model(**enc.inputs, output_hidden_states=True).hidden_states  # L + 1 × [B, n, d]
    for b, s in enumerate(states):
        n = len(enc.tokens[b])
        assert s.shape == (len(out), n, out[0].shape[-1])
        for k in range(len(out)):
            torch.testing.assert_close(s[k], out[k][b, :n], atol=1e-5, rtol=1e-5)


def test_nearest_neighbour():
    inputs = torch.diag(torch.tensor([1.0, 1.0, 10.0, 1.0]))
    mapped = torch.tensor([[1.0, 0.1, 0, 0], [0.9, 0.2, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, -1.0]])
    assert identified(mapped, inputs, "cos").tolist() == [True, False, True, False]
    assert identified(mapped, inputs, "l2").tolist() == [True, False, False, False]  # row 2: too short


def test_probes_recover_a_known_map():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 16, generator=gen)
    a, c = torch.randn(16, 8, generator=gen), torch.randn(8, generator=gen)
    y = x @ a + c
    lin = fit_linear(x, y, ridge=0.0)
    torch.testing.assert_close(lin(x[:5]), y[:5], atol=1e-4, rtol=1e-4)
    mlp = fit_mlp(x, y, hidden=64, epochs=30, seed=0)
    err = (mlp(x) - y).pow(2).sum(-1).mean() / y.pow(2).sum(-1).mean()
    assert err < 0.2  # predicting the mean would leave about 0.9
    assert torch.equal(
        fit_mlp(x, y, hidden=8, epochs=1, seed=3)(x[:3]), fit_mlp(x, y, hidden=8, epochs=1, seed=3)(x[:3])
    )


def test_study_on_real_model(bundled):
    texts = SENTENCES * 4
    rep = identifiability(bundled, texts, train_share=0.5, mlp_epochs=2)
    t = rep.table
    assert list(t["state"]) == list(range(bundled.adapter.n_layers + 1))
    n = bundled.adapter.n_layers  # #32.9: named as the docs name them (layers 0..n−1), not "layer 0..n"
    assert list(t["hidden_state"]) == [
        "embedding output",
        *(f"input of layer {k}" for k in range(1, n)),
        f"output of layer {n - 1}",
    ]
    assert np.allclose(t.loc[0, ["nn_cos", "nn_l2"]], 1.0)  # e^0 is its own nearest neighbour
    assert ((t[["nn_cos", "nn_l2", "linear", "mlp"]] >= 0) & (t[["nn_cos", "nn_l2", "linear", "mlp"]] <= 1)).all().all()
    assert rep.n_train_sentences + rep.n_test_sentences == len(texts)


@pytest.mark.parametrize(
    "kwargs, message", [({"probes": ["knn"]}, "unknown probe"), ({"train_share": 1.0}, "between 0 and 1")]
)
def test_bad_options(bundled, kwargs, message):
    with pytest.raises(MixlensError, match=message):
        identifiability(bundled, SENTENCES, **kwargs)
