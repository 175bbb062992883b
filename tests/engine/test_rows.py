"""Row mode (`rows=`): only the requested rows of every map's target axis, equal to those rows of the full maps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import mixlens
import mixlens.methods.norms as norms
from mixlens.errors import MixlensError
from mixlens.methods import get as get_method
from mixlens.methods.registry import refused_by, with_row_mode
from mixlens.pipeline import resolve_rows, run_methods
from tests.conftest import SENTENCES, random_lens, random_model, run_cli

FAMILIES = ["bert", "gpt2", "llama", "mpnet", "gemma3_text"]  # post-LN, causal pre-LN (LayerNorm, RMS), sandwich


def _rows(full: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows [B, K] of the target axis (third from the end) of [B, ..., n, n] → [B, ..., K, n]."""
    idx = rows.view(rows.shape[0], *[1] * (full.dim() - 3), rows.shape[1], 1)
    return full.gather(-2, idx.expand(*full.shape[:-2], rows.shape[1], full.shape[-1]))


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_equal_the_rows_of_the_full_maps(family, compiled, tokenizer, monkeypatch):
    monkeypatch.setattr(norms, "COMPILED", compiled)
    lens = random_lens(family, tokenizer)
    refused = refused_by(lens.adapter.family)
    methods = [m for m in with_row_mode() if m not in refused]
    enc = lens.encode(SENTENCES)  # three lengths: padded batch
    assert len(set(enc.inputs["attention_mask"].sum(-1).tolist())) == 3
    full = run_methods(lens.trace(enc, ffn=True), methods).values
    heads_full = run_methods(lens.trace(enc), ["attention", "norm"], heads=True).values
    for spec in ("last", [0, -1, 2]):
        tr = lens.trace(enc, ffn=True)
        rows = resolve_rows(spec, tr.lengths)
        got = run_methods(tr, methods, rows=spec).values
        for m in methods:
            want = _rows(full[m], rows)
            assert got[m].shape == want.shape, m
            torch.testing.assert_close(got[m], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=m)
        got = run_methods(lens.trace(enc), ["attention", "norm"], heads=True, rows=spec).values
        for m, v in got.items():
            torch.testing.assert_close(v, _rows(heads_full[m], rows), rtol=1e-5, atol=1e-6, msg=m)


def test_normalised_globenc_rollout_rows(bundled):
    enc = bundled.encode(SENTENCES)
    opts = {"globenc_rollout": {"normalize": True}}
    full = run_methods(bundled.trace(enc, ffn=True), ["globenc_rollout"], options=opts).values["globenc_rollout"]
    tr = bundled.trace(enc, ffn=True)
    got = run_methods(tr, ["globenc_rollout"], options=opts, rows=[1, -2]).values["globenc_rollout"]
    torch.testing.assert_close(got, _rows(full, resolve_rows([1, -2], tr.lengths)), rtol=1e-5, atol=1e-6)


def test_analysis_records_the_rows_and_holds_layers_n_rows(bundled):
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)
    methods = ["norm", "norm_resln", "alti_rollout"]
    full = bundled.analyze([text], methods)
    n, layers = len(full.tokens[0]), bundled.adapter.n_layers
    for k, spec in ((1, "last"), (3, [0, 4, -1])):
        res = bundled.analyze([text, "a rather short one here"], methods, rows=spec)
        for m in methods:
            att = res[m]
            pos = resolve_rows(spec, [n])[0].tolist()
            assert att.rows[0] == pos and att.input(0).shape == (layers, k, n)
            np.testing.assert_allclose(att.input(0), full[m].input(0)[:, pos], rtol=1e-5, atol=1e-5)
            # bytes held: layers · K · (longest input of the block) floats per input, not layers · n²
            assert att.nbytes == 2 * layers * k * n * 4 and full[m].nbytes == layers * n * n * 4
        js = res.to_json()["inputs"][0]["methods"]["norm"]
        assert js["rows"] == pos and np.array(js["values"]).shape == (layers, k, n)
        df = res["norm"].sel(layer=0).to_dataframe()
        assert set(df[df.batch == 0].target) == set(pos)


def test_bytes_held_grow_with_the_rows_not_n_squared(bundled):
    """The same kind of input at two lengths: row-mode results (and the engine's maps) grow as layers · n · K,
    full maps as layers · n²."""
    layers, methods = bundled.adapter.n_layers, ["norm_res", "globenc_rollout", "alti"]
    for words in (8, 32):
        text = " ".join(["word"] * words)
        n = words + 2  # [CLS] words [SEP]
        for spec, k in (("last", 1), ([0, 1, -1], 3), (None, n)):
            res = bundled.analyze([text], methods, rows=spec)
            assert [res[m].nbytes for m in methods] == [layers * k * n * 4] * len(methods)
            bn = run_methods(bundled.trace(bundled.encode([text])), ["norm"], rows=spec).norms
            assert sum(t.nbytes for t in (bn.n, bn.n_res, bn.n_resln)) == 3 * layers * k * n * 4


def test_refusals_and_bad_rows(bundled):
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
            run_methods(tr, ["norm"], rows=bad)
    with pytest.raises(MixlensError, match="'value_zeroing' cannot compute some rows"):
        run_methods(tr, ["value_zeroing"], rows="last")
    assert get_method("attention_flow").name not in with_row_mode()


def test_cli_rows(capsys, tmp_path):
    code, out, err = run_cli(["analyze", "the cat sat", "--rows", "0,-1", "--method", "norm", "-f", "json"], capsys)
    assert code == 0
    m = json.loads(out)["inputs"][0]["methods"]["norm"]
    assert m["rows"] == [0, 4] and len(m["values"][0]) == 2
    for args, message in (
        (["--rows", "9"], "row position 9 is outside input 1 (5 tokens)"),
        (["--rows", "1,x"], "--rows must be"),
        (["--rows", "last", "-f", "html"], "use --rows all"),
    ):
        code, out, err = run_cli(["analyze", "the cat sat", *args], capsys)
        lines = [ln for ln in err.strip().splitlines() if ln]
        assert code == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_default_rows_last_for_long_causal_inputs_in_the_api_and_the_cli(capsys, tmp_path, tokenizer, monkeypatch):
    """The default rows live in the library (`pipeline.auto_rows`): `Lens.analyze` without `rows` and
    `mixlens analyze` without `--rows` agree — the last token's rows for a causal LM's long input, else every
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
        assert json.loads(out)["inputs"][0]["methods"]["norm"].get("rows") == rows
        api = lens.analyze([text], ["norm"])
        assert api["norm"].rows == (None if rows is None else [rows])
        assert api.to_json()["inputs"][0]["methods"]["norm"] == json.loads(out)["inputs"][0]["methods"]["norm"]
    assert random_lens("bert", tokenizer).analyze(["one two three four five six seven"], ["norm"])["norm"].rows is None


def test_deprecated_targets_keyword_and_flag_still_work(capsys, tmp_path, tokenizer):
    """`Lens.analyze(targets=)`, `Attribution.targets` and `analyze --targets` are the deprecated names of `rows`:
    each still gives what `rows` gives, with one DeprecationWarning / one warning line; both flags at once: refused."""
    lens = mixlens.Lens(*_tiny_gpt2(tmp_path, tokenizer))
    text = "one two three four five"
    want = lens.analyze([text], ["norm"], rows=[0, -1])
    with pytest.warns(DeprecationWarning, match=r"targets=\) is deprecated: use rows="):
        old = lens.analyze([text], ["norm"], targets=[0, -1])
    with pytest.warns(DeprecationWarning, match="Attribution.targets is deprecated"):
        assert old["norm"].targets == want["norm"].rows == [[0, len(want.tokens[0]) - 1]]
    np.testing.assert_array_equal(old["norm"].input(0), want["norm"].input(0))
    argv = ["analyze", text, "--model", str(tmp_path), "--method", "norm", "-f", "json"]
    code, new_out, err = run_cli([*argv, "--rows", "0,-1"], capsys)
    assert code == 0 and "deprecated" not in err
    code, old_out, err = run_cli([*argv, "--targets", "0,-1"], capsys)
    warned = [ln for ln in err.splitlines() if "deprecated" in ln]
    assert code == 0 and warned == ["warning: --targets is deprecated, use --rows"]
    assert json.loads(old_out)["inputs"][0]["methods"] == json.loads(new_out)["inputs"][0]["methods"]
    code, _, err = run_cli([*argv, "--rows", "0", "--targets", "0"], capsys)
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        "error: give --rows only (--targets is its deprecated name)"
    )


def test_files_of_earlier_versions_with_targets_keys_are_read(tmp_path, capsys, tokenizer):
    """Saved rows were named 'targets' before: an analysis JSON and an attribution manifest with that key load
    with the same rows as files written now (key 'rows')."""
    from mixlens.result import Analysis, Attribution

    _tiny_gpt2(tmp_path, tokenizer)
    argv = ["analyze", "one two three four five", "--model", str(tmp_path), "--method", "norm", "-f", "json"]
    code, out, _ = run_cli([*argv, "--rows", "0,-1"], capsys)
    assert code == 0
    new = json.loads(out)
    m, last = new["inputs"][0]["methods"]["norm"], len(new["inputs"][0]["tokens"]) - 1
    old = json.loads(json.dumps(new))
    old["inputs"][0]["methods"]["norm"] = {k if k != "rows" else "targets": v for k, v in m.items()}
    assert "rows" in m and "rows" not in old["inputs"][0]["methods"]["norm"]
    for name, obj in (("new.json", new), ("old.json", old)):
        (tmp_path / name).write_text(json.dumps(obj))
        res = Analysis.load(tmp_path / name)
        assert res["norm"].rows == [[0, last]]
        np.testing.assert_array_equal(res["norm"].input(0), np.asarray(m["values"], np.float32))
    attr = Analysis.load(tmp_path / "new.json")["norm"]
    attr.save(tmp_path / "attr")
    manifest = json.loads((tmp_path / "attr.json").read_text())
    assert manifest["rows"] == [[0, last]]
    manifest["targets"] = manifest.pop("rows")
    (tmp_path / "attr.json").write_text(json.dumps(manifest))
    back = Attribution.load(tmp_path / "attr")
    assert back.rows == [[0, last]]
    np.testing.assert_array_equal(back.input(0), attr.input(0))


def _tiny_gpt2(path, tokenizer):
    """A random tiny GPT-2 and `tokenizer` saved at `path`, for the command line and the API alike."""
    model = random_model("gpt2", tokenizer, head="AutoModelForCausalLM")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer
