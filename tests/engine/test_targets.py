"""Target-row mode (`targets=`): only the requested target rows of every map, equal to those rows of the full maps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import mixlens
import mixlens.methods.norms as norms
from mixlens.errors import MixlensError
from mixlens.methods import get as get_method
from mixlens.methods.registry import refused_by, with_target_rows
from mixlens.pipeline import resolve_targets, run_methods
from tests.conftest import SENTENCES, random_lens, random_model, run_cli

FAMILIES = ["bert", "gpt2", "llama", "mpnet", "gemma3_text"]  # post-LN, causal pre-LN (LayerNorm, RMS), sandwich


def _rows(full: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows [B, K] of the target axis (third from the end) of [B, ..., n, n] → [B, ..., K, n]."""
    idx = rows.view(rows.shape[0], *[1] * (full.dim() - 3), rows.shape[1], 1)
    return full.gather(-2, idx.expand(*full.shape[:-2], rows.shape[1], full.shape[-1]))


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_target_rows_equal_the_rows_of_the_full_maps(family, compiled, tokenizer, monkeypatch):
    monkeypatch.setattr(norms, "COMPILED", compiled)
    lens = random_lens(family, tokenizer)
    refused = refused_by(lens.adapter.family)
    methods = [m for m in with_target_rows() if m not in refused]
    enc = lens.encode(SENTENCES)  # three lengths: padded batch
    assert len(set(enc.inputs["attention_mask"].sum(-1).tolist())) == 3
    full = run_methods(lens.trace(enc, ffn=True), methods).values
    heads_full = run_methods(lens.trace(enc), ["attention", "norm"], heads=True).values
    for spec in ("last", [0, -1, 2]):
        tr = lens.trace(enc, ffn=True)
        rows = resolve_targets(spec, tr.lengths)
        got = run_methods(tr, methods, targets=spec).values
        for m in methods:
            want = _rows(full[m], rows)
            assert got[m].shape == want.shape, m
            torch.testing.assert_close(got[m], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=m)
        got = run_methods(lens.trace(enc), ["attention", "norm"], heads=True, targets=spec).values
        for m, v in got.items():
            torch.testing.assert_close(v, _rows(heads_full[m], rows), rtol=1e-5, atol=1e-6, msg=m)


def test_normalised_globenc_rollout_rows(bundled):
    enc = bundled.encode(SENTENCES)
    opts = {"globenc_rollout": {"normalize": True}}
    full = run_methods(bundled.trace(enc, ffn=True), ["globenc_rollout"], options=opts).values["globenc_rollout"]
    tr = bundled.trace(enc, ffn=True)
    got = run_methods(tr, ["globenc_rollout"], options=opts, targets=[1, -2]).values["globenc_rollout"]
    torch.testing.assert_close(got, _rows(full, resolve_targets([1, -2], tr.lengths)), rtol=1e-5, atol=1e-6)


def test_analysis_records_the_target_rows_and_holds_layers_n_targets(bundled):
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)
    methods = ["norm", "norm_resln", "alti_rollout"]
    full = bundled.analyze([text], methods)
    n, layers = len(full.tokens[0]), bundled.adapter.n_layers
    for k, spec in ((1, "last"), (3, [0, 4, -1])):
        res = bundled.analyze([text, "a rather short one here"], methods, targets=spec)
        for m in methods:
            att = res[m]
            pos = resolve_targets(spec, [n])[0].tolist()
            assert att.targets[0] == pos and att.input(0).shape == (layers, k, n)
            np.testing.assert_allclose(att.input(0), full[m].input(0)[:, pos], rtol=1e-5, atol=1e-5)
            # bytes held: layers · K · (longest input of the block) floats per input, not layers · n²
            assert att.nbytes == 2 * layers * k * n * 4 and full[m].nbytes == layers * n * n * 4
        js = res.to_json()["inputs"][0]["methods"]["norm"]
        assert js["targets"] == pos and np.array(js["values"]).shape == (layers, k, n)
        df = res["norm"].sel(layer=0).to_dataframe()
        assert set(df[df.batch == 0].target) == set(pos)


def test_bytes_held_grow_with_the_targets_not_n_squared(bundled):
    """The same kind of input at two lengths: target-row results (and the engine's maps) grow as layers · n · K,
    full maps as layers · n²."""
    layers, methods = bundled.adapter.n_layers, ["norm_res", "globenc_rollout", "alti"]
    for words in (8, 32):
        text = " ".join(["word"] * words)
        n = words + 2  # [CLS] words [SEP]
        for spec, k in (("last", 1), ([0, 1, -1], 3), (None, n)):
            res = bundled.analyze([text], methods, targets=spec)
            assert [res[m].nbytes for m in methods] == [layers * k * n * 4] * len(methods)
            bn = run_methods(bundled.trace(bundled.encode([text])), ["norm"], targets=spec).norms
            assert sum(t.nbytes for t in (bn.n, bn.n_res, bn.n_resln)) == 3 * layers * k * n * 4


def test_refusals_and_bad_targets(bundled):
    tr = bundled.trace(bundled.encode(["one two"]))
    for bad, msg in (
        ([7], "outside input 1 (4 tokens)"),
        ([-5], "outside"),
        ([1, -3], "same position twice"),
        ("first", "'all', 'last'"),
        ([], "non-empty"),
        ([1.5], "integer"),
    ):
        with pytest.raises(MixlensError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            run_methods(tr, ["norm"], targets=bad)
    with pytest.raises(MixlensError, match="'value_zeroing' cannot compute target rows"):
        run_methods(tr, ["value_zeroing"], targets="last")
    assert get_method("attention_flow").name not in with_target_rows()


def test_cli_targets(capsys, tmp_path):
    code, out, err = run_cli(["analyze", "the cat sat", "--targets", "0,-1", "--method", "norm", "-f", "json"], capsys)
    assert code == 0
    m = json.loads(out)["inputs"][0]["methods"]["norm"]
    assert m["targets"] == [0, 4] and len(m["values"][0]) == 2
    for args, message in (
        (["--targets", "9"], "target position 9 is outside input 1 (5 tokens)"),
        (["--targets", "1,x"], "--targets must be"),
        (["--targets", "last", "-f", "html"], "use --targets all"),
    ):
        code, out, err = run_cli(["analyze", "the cat sat", *args], capsys)
        lines = [ln for ln in err.strip().splitlines() if ln]
        assert code == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_default_targets_last_for_long_causal_inputs_in_the_api_and_the_cli(capsys, tmp_path, tokenizer, monkeypatch):
    """The default target rows live in the library (`pipeline.auto_targets`): `Lens.analyze` without `targets` and
    `mixlens analyze` without `--targets` agree — the last token's rows for a causal LM's long input, else every
    row — and an encoder keeps full maps whatever the length."""
    import mixlens.pipeline as pipeline

    model = random_model("gpt2", tokenizer, head="AutoModelForCausalLM")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    lens = mixlens.Lens(model, tokenizer)
    monkeypatch.setattr(pipeline, "LONG_CAUSAL", 6)
    for text, rows in (("a b c", None), ("one two three four five six seven", [8])):
        code, out, _ = run_cli(["analyze", text, "--model", str(tmp_path), "--method", "norm", "-f", "json"], capsys)
        assert code == 0
        assert json.loads(out)["inputs"][0]["methods"]["norm"].get("targets") == rows
        api = lens.analyze([text], ["norm"])
        assert api["norm"].targets == (None if rows is None else [rows])
        assert api.to_json()["inputs"][0]["methods"]["norm"] == json.loads(out)["inputs"][0]["methods"]["norm"]
    assert (
        random_lens("bert", tokenizer).analyze(["one two three four five six seven"], ["norm"])["norm"].targets is None
    )
