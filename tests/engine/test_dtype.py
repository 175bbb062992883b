"""The checkpoint's own dtype (`mixlens.load(dtype=...)`, `Lens(..., dtype=...)`): the forward pass runs in it, the
decompositions accumulate in float32 and their exactness checks allow its rounding (`norms.TOLERANCES`), no more."""

from __future__ import annotations

import pytest
import torch

import mixlens
from mixlens import rowattn
from mixlens.errors import MixlensError, ReconstructionError
from mixlens.methods import norms
from tests.conftest import SENTENCES, random_lens, random_model

NORM_FAMILY = ["norm", "norm_res", "norm_resln"]


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_bfloat16_runs_in_bfloat16_and_checks_within_its_tolerance(tokenizer, family):
    lens = mixlens.Lens(random_model(family, tokenizer), tokenizer, dtype="bfloat16")
    assert lens.dtype == torch.bfloat16
    tr = lens.trace(lens.encode(SENTENCES))
    assert tr.layers[0].alpha.dtype == torch.float32  # captured as it ran, upcast for the methods
    res = lens.analyze(SENTENCES, NORM_FAMILY)
    assert 0 < res.reconstruction_error.max() <= norms.TOLERANCES[torch.bfloat16] * 10  # absolute, stream ≤ 10
    ref = random_lens(family, tokenizer).analyze(SENTENCES, NORM_FAMILY)
    for m in NORM_FAMILY:  # the same model in float32: maps agree to bfloat16's rounding
        for a, b in zip(res[m].values, ref[m].values, strict=True):
            assert a.dtype == b.dtype
            assert abs(a - b).max() <= 0.05 * max(1.0, abs(b).max())


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_corrupted_weight_still_trips_the_check(tokenizer, family, dtype):
    lens = mixlens.Lens(random_model(family, tokenizer), tokenizer, dtype=dtype)
    lay = lens.adapter.layers[1]
    lay.raw_w_o = lay.raw_w_o * 1.1  # the decomposition's W_O, 10% off the model's
    with pytest.raises(ReconstructionError, match="layer 1"):
        lens.analyze(SENTENCES, ["norm"])


def test_lens_keeps_float32_unless_asked(tokenizer):
    model = random_model("gpt2", tokenizer).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="fp32"):
        assert mixlens.Lens(model, tokenizer).dtype == torch.float32
    model = random_model("gpt2", tokenizer).to(torch.bfloat16)
    assert mixlens.Lens(model, tokenizer, dtype="auto").dtype == torch.bfloat16


def test_load_dtype(bundled):
    lens = mixlens.load(dtype="bfloat16")
    assert lens.dtype == torch.bfloat16 and lens.device.type == "cpu"
    assert mixlens.load(dtype="auto").dtype == torch.float32  # the bundled config names no dtype
    res = lens.analyze(SENTENCES[:1], ["norm_resln"])
    ref = bundled.analyze(SENTENCES[:1], ["norm_resln"])
    a, b = res["norm_resln"].values[0], ref["norm_resln"].values[0]
    assert abs(a - b).max() < 0.02 * abs(b).max()
    with pytest.raises(MixlensError, match="unknown dtype 'float64'"):
        mixlens.load(dtype="float64")


def test_checkpoint_dtype():
    from types import SimpleNamespace

    from mixlens.lens import checkpoint_dtype

    assert checkpoint_dtype(SimpleNamespace(dtype=torch.bfloat16)) == "bfloat16"
    assert checkpoint_dtype(SimpleNamespace(dtype="float16")) == "float16"
    assert checkpoint_dtype(SimpleNamespace(dtype=None)) == "float32"
    assert checkpoint_dtype(SimpleNamespace()) == "float32"


def test_device_resolution(monkeypatch):
    from mixlens.lens import resolve_device

    assert resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(MixlensError, match="CUDA is not available"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == "cuda"
    with pytest.raises(MixlensError, match="has 2 CUDA device"):
        resolve_device("cuda:2")
    with pytest.raises(MixlensError, match="unknown device 'gpu'"):
        resolve_device("gpu")


def test_a_dtype_the_device_cannot_run_is_one_error(monkeypatch):
    from mixlens import lens as lens_module

    def broken(*a, **k):
        raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'\nmore")

    monkeypatch.setattr(torch.nn.functional, "layer_norm", broken)
    with pytest.raises(MixlensError, match='^dtype float16 cannot run on cpu: "addmm_impl_cpu_" not implemented'):
        lens_module.check_dtype_on(torch.float16, "cpu")


@pytest.mark.cuda
def test_bfloat16_on_cuda(tokenizer):
    lens = mixlens.Lens(random_model("llama", tokenizer).to("cuda"), tokenizer, dtype="bfloat16")
    res = lens.analyze(SENTENCES, [*NORM_FAMILY, "globenc", "alti", "attention_rollout"])
    assert res.reconstruction_error.max() < 1
    assert mixlens.load(device="cuda", dtype="bfloat16").device.type == "cuda"


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_every_decoder_method_runs_on_a_bfloat16_causal_lm(tokenizer, family):
    """Every method that explains a causal LM's prediction runs on a bfloat16 model (the captures are float32, the
    modules the methods call again are bfloat16) and gives finite scores."""
    import numpy as np

    from mixlens.explain.attributions import default_methods

    model = random_model(family, tokenizer, head="AutoModelForCausalLM").to(torch.bfloat16)
    lens = mixlens.Lens(model, tokenizer, dtype="auto")
    methods = default_methods("causal", lens.adapter.family)
    options = {"integrated_gradients": {"steps": 4}, "gradient_shap": {"samples": 2}, "lime": {"samples": 4}}
    res = lens.analyze(SENTENCES[:1], methods, options={k: v for k, v in options.items() if k in methods})
    for m in methods:
        assert np.isfinite(res[m].values).all(), m


def _sharp_bfloat16_lm(tokenizer, monkeypatch) -> mixlens.Lens:
    """A random causal LM in bfloat16 whose attention scores reach tens to hundreds, as real checkpoints' do (Qwen2.5's
    first layer): q and K weights × 30."""
    model = random_model("llama", tokenizer, head="AutoModelForCausalLM")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    monkeypatch.setattr(tokenizer, "model_max_length", 2048)
    return mixlens.Lens(model, tokenizer, dtype="bfloat16")


@pytest.mark.parametrize("n", [64, 256, 1024])
def test_bfloat16_long_inputs_in_row_mode_pass_the_check_and_a_broken_piece_does_not(tokenizer, n, monkeypatch):
    """Target rows of a long bfloat16 input (row mode: α's rows formed again from q and K after the forward pass):
    the check passes at every length with the same margin (the decomposition adds no error that grows with n), and
    still trips on a broken piece: W_O 10 % off (the target and seeded rows are checked, each against its own size),
    or α's scores rounded to bfloat16 (rows that are not the ones the output was computed from: 6–8 % of the
    attention output here)."""
    lens = _sharp_bfloat16_lm(tokenizer, monkeypatch)
    text = " ".join(["the cat sat on a mat"] * (n // 6))
    res = lens.analyze([text], ["norm"], max_length=n, rows="last")
    assert res.error_share is not None and 0 < float(res.error_share.max()) <= 0.5
    lay = lens.adapter.layers[1]
    w_o = lay.raw_w_o
    lay.raw_w_o = w_o * 1.1
    with pytest.raises(ReconstructionError, match="layer 1"):
        lens.analyze([text], ["norm"], max_length=n, rows="last")
    lay.raw_w_o = w_o
    scores = rowattn.QKRows._scores
    monkeypatch.setattr(rowattn.QKRows, "_scores", lambda *a, **k: scores(*a, **k).bfloat16().float())
    with pytest.raises(ReconstructionError):
        lens.analyze([text], ["norm"], max_length=n, rows="last")


def test_the_cli_loads_with_the_same_dtype_device_and_family_as_the_api(tokenizer, tmp_path, monkeypatch, capsys):
    """`--dtype` / `--device` / `--family` reach `mixlens.load` as its explicit arguments (no ambient context): the
    command's model is the one `mixlens.load(DIR, dtype=, device=, family=)` gives, with the same results."""
    import json

    import mixlens.lens as lens_module
    from mixlens.loading import DTYPES, resolve_device
    from tests.conftest import run_cli

    model = random_model("gpt2", tokenizer, head="AutoModelForCausalLM")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    calls: list[tuple[dict, mixlens.Lens]] = []
    real_load = lens_module.load

    def spy(*args, **kwargs):
        calls.append((kwargs, real_load(*args, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(lens_module, "load", spy)
    text = "the cat sat on the mat"
    argv = ["analyze", text, "--model", str(tmp_path), "--method", "norm", "-f", "json"]
    for given, want in (
        (["--dtype", "bfloat16", "--device", "cpu"], ("bfloat16", "cpu", None)),
        (["--family", "gpt2", "--device", "auto"], (None, resolve_device("auto"), "gpt2")),  # resolved before loading
        ([], (None, None, None)),
    ):
        code, out, err = run_cli([*argv, *given], capsys)
        assert code == 0, err
        kwargs, cli = calls[-1]
        assert (kwargs["dtype"], kwargs["device"], kwargs["family"]) == want
        api = real_load(str(tmp_path), dtype=want[0], device=want[1], family=want[2])
        assert (cli.dtype, cli.device, cli.adapter.family) == (api.dtype, api.device, api.adapter.family)
        assert cli.dtype == DTYPES[want[0] or "float32"] and cli.device == torch.device(want[1] or "cpu")
        got = json.loads(out)["inputs"][0]["methods"]["norm"]["values"]
        assert got == api.analyze([text], ["norm"]).to_json()["inputs"][0]["methods"]["norm"]["values"]
