"""What `Lens.analyze` keeps per input: the norm-output bias g_i(b_O) + β is stored as the per-token scale s_i and
built when read, equal to the engine's own `BlockNorms.bias` of each input."""

import numpy as np

from mixlens import Analysis
from mixlens.methods.norms import block_norms
from mixlens.result import InputBiasRows

TEXTS = ["A short one.", "A somewhat longer sentence, with a clause and more words in it.", "Two words"]


def test_bias_is_built_from_the_scale_and_equals_the_engine(bundled, tmp_path):
    res = bundled.analyze(TEXTS, ["norm"], batch_size=2)
    store = res.bias_store
    assert isinstance(store, InputBiasRows)
    layers, d = bundled.adapter.n_layers, bundled.model.config.hidden_size
    scale_floats = sum(layers * max(len(res.tokens[b]) for b in i) * len(i) for i, _ in store.scale.parts)
    assert store.nbytes == 4 * (scale_floats + layers * 2 * d)  # L·n floats per input, not L·n·d
    for b, text in enumerate(TEXTS):
        n = len(res.tokens[b])
        ref = block_norms(bundled.trace([text], to_output=False)).bias[0].numpy()  # [L, n, d]
        np.testing.assert_allclose(store.row(b), ref, atol=1e-6)
        np.testing.assert_allclose(res.bias[b, :, :n], ref, atol=1e-6)
        assert not res.bias[b, :, n:].any()  # padding 0
    both = Analysis.concat([res, res])
    assert isinstance(both.bias_store, InputBiasRows)
    np.testing.assert_array_equal(both.bias[len(TEXTS) :], res.bias)
    res.save(tmp_path / "a")
    np.testing.assert_array_equal(Analysis.load(tmp_path / "a").bias, res.bias)
