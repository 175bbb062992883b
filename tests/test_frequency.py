"""Word frequency vs. mixing: per-token norms against explicit vectors, word frequencies of subwords."""

from __future__ import annotations

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
    tr = bundled.trace(bundled.encode(SENTENCES), full=False)
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
