"""Word frequency vs. mixing: per-token norms against explicit vectors, word frequencies of subwords."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from mixlens.bertology.frequency import QUANTITIES, frequency_study, token_norms, zipf
from mixlens.errors import MixlensError
from mixlens.methods.norms import head_vectors
from tests.conftest import SENTENCES


@torch.no_grad()
def test_own_and_context_norms_from_explicit_vectors(bundled):
    tr = bundled.trace(bundled.encode(SENTENCES), to_output=False)
    q = token_norms(tr)
    for layer, (lt, lay) in enumerate(zip(tr.layers, bundled.adapter.layers, strict=True)):
        u = torch.einsum("bhij,bhjd->bijd", lt.alpha.float(), head_vectors(lt, lay))  # [B, i, j, d]
        s = lay.ln_mix.scale(lt.mix_in)[..., None]  # [B, n, 1]
        own = lay.ln_mix.project(u.diagonal(dim1=1, dim2=2).transpose(1, 2) + lt.x) / s
        context = lay.ln_mix.project(u.sum(2) - u.diagonal(dim1=1, dim2=2).transpose(1, 2)) / s
        m = tr.mask
        np.testing.assert_allclose(q["self"][:, layer][m], own.norm(dim=-1)[m], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(q["context"][:, layer][m], context.norm(dim=-1)[m], rtol=1e-3, atol=1e-4)


def test_subwords_take_their_words_frequency(bundled):
    text = "the unbelievably charming film"
    pieces = bundled.tokenizer.tokenize("unbelievably")
    assert len(pieces) > 1  # the test needs a word split into pieces
    rep = frequency_study(bundled, [text])
    t = rep.tokens
    assert list(t["word"]) == ["the"] + ["unbelievably"] * len(pieces) + ["charming", "film"]
    for w in ("the", "unbelievably", "charming", "film"):
        assert np.allclose(t.loc[t["word"] == w, "zipf"], zipf(w))
    assert zipf("the") > zipf("charming") > 0
    assert rep.left_out == 2  # [CLS] and [SEP]
    for layer in range(rep.n_layers):
        for k in QUANTITIES:
            assert rep.rho.loc[layer, f"rho_{k}"] == pytest.approx(spearmanr(t["zipf"], t[f"{k}_{layer}"]).statistic)


def test_unknown_words_only(bundled):
    with pytest.raises(MixlensError, match="no token has a known word frequency"):
        frequency_study(bundled, ["qzxwv"])


def test_mixing_profile_matches_analysis(bundled):
    from mixlens.bertology.mixing_disabling import mixing_profile

    ratio, share = mixing_profile(bundled, SENTENCES, batch_size=2)
    an = bundled.analyze(SENTENCES, ["norm"])
    per_token = an.mixing_ratio("ResLN-N", per_token=True)  # [B, L, n], padding 0
    n_tokens = sum(len(t) for t in an.tokens)
    np.testing.assert_allclose(ratio, per_token.sum((0, 2)) / n_tokens, rtol=1e-5)
    np.testing.assert_allclose(share.sum(1), 1.0, rtol=1e-5)
    assert share.shape == (bundled.adapter.n_layers, bundled.adapter.n_heads) and np.all(share > 0)


def test_mixing_vs_disabling_on_a_small_model(tokenizer):
    from mixlens.bertology.mixing_disabling import mixing_vs_disabling
    from mixlens.bertology.sweep import sweep
    from mixlens.bertology.tasks import StsTask
    from tests.conftest import random_lens

    lens = random_lens("bert", tokenizer, num_hidden_layers=3)
    pairs = [
        (SENTENCES[0], SENTENCES[1]),
        (SENTENCES[1], SENTENCES[2]),
        (SENTENCES[0], SENTENCES[2]),
        ("A cat.", "A dog sat."),
    ]
    task = StsTask(lens, pairs, [1.0, 2.0, 3.0, 0.5])
    rep = mixing_vs_disabling(lens, task, [s for p in pairs for s in p], modes=("zero",))
    direct = sweep(lens, task, "zero")
    np.testing.assert_allclose(rep.layer_harm["zero"], -direct.delta_layers)  # Spearman: higher is better
    np.testing.assert_allclose(rep.head_harm["zero"], -direct.delta_heads)
    assert rep.ratio.shape == (3,) and rep.share.shape == direct.heads.shape
    shifted = dataclasses.replace(direct, heads=direct.heads + 1.0)  # a finished sweep is used, not rerun
    again = mixing_vs_disabling(lens, task, [s for p in pairs for s in p], modes=("zero",), done={"zero": shifted})
    np.testing.assert_allclose(again.head_harm["zero"], rep.head_harm["zero"] - 1.0)
    np.testing.assert_allclose(again.ratio, rep.ratio)
