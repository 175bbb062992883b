"""Results that reload: Analysis save/load/concat, the terminal view, report/plot --from without a model, and
safe loading of crafted files (every bad file is one MixlensError line)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from safetensors.numpy import save

from mixlens.errors import MixlensError
from mixlens.result import Analysis, Attribution, InputRows
from tests.conftest import SENTENCES, random_lens, run_cli

TEXTS = [SENTENCES[0], "Short one.", SENTENCES[1], "A fourth, medium input."]
METHODS = ["attention", "norm", "norm_resln"]


@pytest.fixture(scope="module")
def lens(tokenizer):
    return random_lens("bert", tokenizer)


@pytest.fixture(scope="module")
def res(lens) -> Analysis:
    out = lens.analyze(TEXTS, METHODS, batch_size=2)
    assert len(out["norm"].store.parts) == 2  # several blocks: the per-batch storage is what gets saved
    # a hand-made secondary output per input, stored per block like a method's extras
    delta = out["norm"].store.map(lambda a: a[:, 0, 0, 0], ())
    out["norm"].extra_store["delta"] = delta
    return out


def same(a: Analysis, b: Analysis) -> None:
    assert (a.model, a.version, a.texts, a.tokens) == (b.model, b.version, b.texts, b.tokens)
    assert list(a.attributions) == list(b.attributions)
    for m, x in a.attributions.items():
        y = b[m]
        assert (x.dims, x.params, x.words, list(x.extra_store)) == (y.dims, y.params, y.words, list(y.extra_store))
        for k in range(len(a)):
            np.testing.assert_array_equal(x.input(k), y.input(k))
            for e in x.extra_store:
                np.testing.assert_array_equal(x.extra_store[e].row(k), y.extra_store[e].row(k))
    for v in a.ratio_store:
        np.testing.assert_array_equal(a.mixing_ratio(v, per_token=True), b.mixing_ratio(v, per_token=True))
    np.testing.assert_array_equal(a.bias, b.bias)
    np.testing.assert_array_equal(a.reconstruction_error, b.reconstruction_error)


def test_save_load_round_trip(res, tmp_path):
    res.save(tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "run.safetensors"]  # no temp files left
    back = Analysis.load(tmp_path / "run")
    same(res, back)
    assert [i.tolist() for i, _ in back["norm"].store.parts] == [i.tolist() for i, _ in res["norm"].store.parts]
    same(back, Analysis.load(tmp_path / "run.safetensors"))
    res["norm"].save(tmp_path / "norm")
    att = Attribution.load(tmp_path / "norm")
    assert att.extras["delta"].shape == (len(TEXTS),) and len(att.store.parts) == 2
    with pytest.raises(MixlensError, match="is a saved analysis: use Analysis.load"):
        Attribution.load(tmp_path / "run")


def test_load_analyze_json(res, tmp_path):
    path = tmp_path / "out.json"
    path.write_text(json.dumps(res.to_json()))
    back = Analysis.load(path)
    assert back.tokens == res.tokens and back.ratio_means_only
    for m in METHODS:
        for b in range(len(TEXTS)):
            np.testing.assert_allclose(back[m].input(b), res[m].input(b), rtol=1e-6)
    np.testing.assert_allclose(back["norm"].extras["delta"], res["norm"].extras["delta"], rtol=1e-6)
    np.testing.assert_allclose(back.mixing_ratio("N"), res.mixing_ratio("N"), rtol=1e-5)
    np.testing.assert_allclose(back.reconstruction_error, res.reconstruction_error, rtol=1e-6)
    with pytest.raises(MixlensError, match="only per-layer means"):
        back.mixing_ratio(per_token=True)


def test_concat_equals_one_call(lens, res):
    a = lens.analyze(TEXTS[:1], METHODS)
    b = lens.analyze(TEXTS[1:], METHODS, batch_size=2)
    both = Analysis.concat([a, b])
    assert both.texts == res.texts and both.tokens == res.tokens
    for m in METHODS:
        for k in range(len(TEXTS)):
            np.testing.assert_allclose(both[m].input(k), res[m].input(k), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(both.mixing_ratio(), res.mixing_ratio(), rtol=1e-5)
    assert both.bias.shape == res.bias.shape and both.reconstruction_error.shape == (len(TEXTS),)


def test_concat_refuses_mismatches(lens):
    a = lens.analyze(TEXTS[:1], ["norm"])
    for other, msg in (
        (lens.analyze(TEXTS[1:2], ["attention"]), "other methods"),
        (lens.analyze(TEXTS[1:2], ["norm"], heads=True), "other methods, options"),
        (
            Analysis(
                "other-model",
                a.version,
                a.texts,
                a.tokens,
                a.attributions,
                a.ratio_store,
                a.reconstruction_error,
                a.bias_store,
            ),
            "comes from other-model",
        ),
    ):
        with pytest.raises(MixlensError, match=msg):
            Analysis.concat([a, other])
    with pytest.raises(MixlensError, match="nothing to concatenate"):
        Analysis.concat([])


def test_show(res):
    con = Console(record=True, width=300)
    res["norm"].show(0, console=con)
    text = con.export_text()
    assert "norm — input 1 (layer 1)" in text and "[CLS]" in text and "cabinet" in text
    res["norm"].show(1, layer=0, max_tokens=3, console=con)
    text = con.export_text()  # (export clears the record)
    assert "(layer 0)" in text and "the first 3 of 5 tokens" in text
    tokens = res.tokens
    vec = Attribution(np.stack([np.arange(len(tokens[0]), dtype=np.float32)] * 1), ("source",), tokens[:1], "s")
    vec.show(console=con)
    out = con.export_text()
    assert "score" in out and "█" in out
    cls = Attribution(np.ones((1, 2, len(tokens[0])), np.float32), ("class", "source"), tokens[:1], "c")
    cls.show(console=con)
    assert "class 1" in con.export_text()
    with pytest.raises(MixlensError, match="layer 9 out of range"):
        res["norm"].show(0, layer=9, console=con)
    with pytest.raises(MixlensError, match="no per-head values"):
        res["norm"].show(0, head=0, console=con)


def test_report_and_plot_from_file_load_no_model(res, tmp_path, monkeypatch, capsys):
    import mixlens.lens

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(mixlens.lens, "load", no_model)
    res.save(tmp_path / "run")
    (tmp_path / "out.json").write_text(json.dumps(res.to_json()))
    for src in ("run", "out.json"):
        page = tmp_path / f"{src}.html"
        code, _, err = run_cli(["report", "--from", str(tmp_path / src), "--out", str(page)], capsys)
        assert code in (0, None), err
        assert "cabinet" in page.read_text()
        for view in ("heatmap", "ratio"):
            fig = tmp_path / f"{src}-{view}.png"
            code, _, err = run_cli(
                ["plot", "--from", str(tmp_path / src), "--view", view, "--method", "norm", "--out", str(fig)], capsys
            )
            assert code in (0, None) and fig.read_bytes()[:4] == b"\x89PNG", err
    for argv, msg in (
        (["report", "A text.", "--from", str(tmp_path / "run")], "not both"),
        (["report"], "give one or more texts"),
        (["plot", "--from", str(tmp_path / "run"), "--method", "alti"], "'alti' was not computed"),
        (["report", "--from", str(tmp_path / "missing")], "cannot read"),
    ):
        code, _, err = run_cli([*argv, "--out", str(tmp_path / ("x.png" if argv[0] == "plot" else "x.html"))], capsys)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err


# ---- safe loading ----


def _header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _with_header(path: Path, header: dict, body: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + body)


def _refused(load, path: Path, msg: str) -> None:
    with pytest.raises(MixlensError) as e:
        load(path)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.fixture
def saved(res, tmp_path) -> tuple[Path, Path]:
    """(a saved attribution, a saved analysis) with fresh files for each test."""
    res["norm"].save(tmp_path / "att")
    res.save(tmp_path / "run")
    return tmp_path / "att", tmp_path / "run"


def test_crafted_manifests(saved):
    att, run = saved
    good_att = json.loads(att.with_suffix(".json").read_text())
    good_run = json.loads(run.with_suffix(".json").read_text())
    for load, path, good in ((Attribution.load, att, good_att), (Analysis.load, run, good_run)):
        man = path.with_suffix(".json")
        man.write_text("[1, 2]")
        _refused(load, path, "is not a JSON object")
        man.write_text("{not json")
        _refused(load, path, "is not valid JSON")
        man.write_text(json.dumps({k: v for k, v in good.items() if k != "tokens"}))
        _refused(load, path, "missing field 'tokens'")
        man.write_text(json.dumps({**good, "tokens": [["a"]] * len(good["tokens"]), "words": None}))
        _refused(load, path, "positions but its longest input has 1 tokens")  # values disagree with the tokens
        man.write_text(
            json.dumps(
                {
                    **good,
                    "tokens": good["tokens"][:-1],
                    "words": None,
                    **({"texts": good["texts"][:-1]} if "texts" in good else {}),
                }
            )
        )
        _refused(load, path, "outside 1..3")
        man.write_text(json.dumps({**good, "save_id": "0" * 32}))
        _refused(load, path, "different saves")
        man.write_text(json.dumps({**good, "words": [[0]] * len(good["tokens"])}))
        _refused(load, path, "'words' must give a word id")
    att.with_suffix(".json").write_text(json.dumps({**good_att, "dims": ["batch", "layer", "target"]}))
    _refused(Attribution.load, att, "expected 2 rows of axes [layer, target]")  # wrong axis count
    att.with_suffix(".json").write_text(json.dumps({**good_att, "dims": ["layer", "target", "source"]}))
    _refused(Attribution.load, att, "must start with 'batch'")
    methods = {**good_run["methods"], "norm": {**good_run["methods"]["norm"], "blocks": 5}}
    run.with_suffix(".json").write_text(json.dumps({**good_run, "methods": methods}))
    _refused(Analysis.load, run, "block 2 is missing")
    methods = {**good_run["methods"], "norm": {**good_run["methods"]["norm"], "blocks": "2"}}
    run.with_suffix(".json").write_text(json.dumps({**good_run, "methods": methods}))
    _refused(Analysis.load, run, "no valid block count")
    run.with_suffix(".json").write_text(json.dumps({"model": "m"}))
    _refused(Analysis.load, run, "neither a saved analysis nor the JSON")


def test_crafted_tensor_files(saved):
    att, run = saved
    for load, path in ((Attribution.load, att), (Analysis.load, run)):
        st = path.with_suffix(".safetensors")
        good = st.read_bytes()
        header, body = _header(st)
        st.write_bytes(good[:5])
        _refused(load, path, "not a valid safetensors file: 5 bytes")
        st.write_bytes((10**9).to_bytes(8, "little") + good[8:])
        _refused(load, path, "header length 1000000000 exceeds the file")
        st.write_bytes(good[: len(good) // 2])  # truncated: the data ranges run past the end
        _refused(load, path, "data range")
        name = next(k for k in header if k != "__metadata__")
        huge = {**header, name: {**header[name], "shape": [2**40, 2**40, 2**40]}}
        _with_header(st, huge, body)
        _refused(load, path, f"tensor '{name}' of shape [{2**40}, {2**40}, {2**40}] needs")
        _with_header(st, {**header, name: {**header[name], "dtype": "BOOL"}}, body)
        _refused(load, path, f"tensor '{name}' has a malformed entry")
        _with_header(st, {**header, name: "x"}, body)
        _refused(load, path, "malformed entry")
        st.write_bytes(len(b"[]").to_bytes(8, "little") + b"[]")
        _refused(load, path, "the header is not a JSON object")
        st.write_bytes(good)
    # a well-formed file with arrays that disagree with the manifest (same save id, so only the content is wrong)
    meta = _header(att.with_suffix(".safetensors"))[0]["__metadata__"]
    man = json.loads(att.with_suffix(".json").read_text())
    n0 = max(len(man["tokens"][b]) for b in (0, 2))  # block 0 holds the two longest inputs
    bad = {
        "values.0": np.zeros((2, 2, n0, n0), np.float32),
        "index.0": np.array([0, 0]),
        "values.1": np.zeros((2, 2, 8, 8), np.float32),
        "index.1": np.array([1, 3]),
    }
    for tensors, msg in (
        ({**bad}, "an input appears in more than one row"),
        ({**bad, "index.0": np.array([0, 9])}, "names inputs outside"),
        ({**bad, "index.0": np.array([0.0, 2.0])}, "no list of input numbers"),
        (
            {**bad, "index.0": np.array([0, 2]), "values.0": np.zeros((2, 2, n0, n0), np.int64)},
            "not floating-point values",
        ),
        (
            {**bad, "index.0": np.array([0, 2]), "values.0": np.zeros((2, n0, n0), np.float32)},
            "expected 2 rows of axes [layer, target, source]",
        ),
    ):
        att.with_suffix(".safetensors").write_bytes(save(tensors, metadata=meta))
        _refused(Attribution.load, att, msg)


def test_crafted_analyze_json(res, tmp_path):
    good = res.to_json()
    path = tmp_path / "a.json"
    inp = good["inputs"][0]
    cases = (
        ({**good, "inputs": []}, "non-empty 'inputs' list"),
        ({**good, "inputs": [{**inp, "tokens": "abc"}]}, "'tokens' must be a non-empty list of strings"),
        (
            {**good, "inputs": [{**inp, "methods": {"norm": {**inp["methods"]["norm"], "values": [[1, 2], [3]]}}}]},
            "not a regular array",
        ),
        (
            {**good, "inputs": [{**inp, "methods": {"norm": {**inp["methods"]["norm"], "values": [[[1.0]]]}}}]},
            "axis 'target' has 1 entries for",
        ),
        (
            {**good, "inputs": [{**inp, "methods": {"norm": {**inp["methods"]["norm"], "dims": ["layer"]}}}]},
            "values have 3 axes, the dims name 1",
        ),
        ({**good, "inputs": [inp, {**good["inputs"][1], "methods": {}}]}, "other methods or ratio variants"),
        ({**good, "inputs": [{**inp, "reconstruction_error": "0"}]}, "must be a number or null"),
    )
    for obj, msg in cases:
        path.write_text(json.dumps(obj))
        _refused(Analysis.load, path, msg)


def test_blocks_checked_accepts_what_analyze_wrote(res):
    s = res["norm"].store
    again = InputRows.checked(s.parts, s.dims, s.lengths, "x")
    np.testing.assert_array_equal(again.full(), s.full())


def test_concat_keeps_the_row_positions_of_row_mode(tokenizer, tmp_path):
    """Row mode (`rows=`): the concatenation keeps each input's row positions (`Attribution.rows`), equal to one
    call's, in its JSON and saved and loaded again; mixing a row-mode analysis with a full one is refused."""
    lens = random_lens("gpt2", tokenizer)
    texts, rows = [SENTENCES[0], "Short one.", SENTENCES[1]], [0, -1]
    methods = ["norm", "attention"]
    one = lens.analyze(texts, methods, rows=rows)
    both = Analysis.concat([lens.analyze(texts[:1], methods, rows=rows), lens.analyze(texts[1:], methods, rows=rows)])
    assert one["norm"].rows == [[0, 11], [0, 4], [0, 12]]  # -1: each input's last token
    for m in methods:
        assert both[m].rows == one[m].rows
        for k in range(len(texts)):
            np.testing.assert_allclose(both[m].input(k), one[m].input(k), rtol=1e-5, atol=1e-6)
    got = [i["methods"]["norm"]["rows"] for i in both.to_json()["inputs"]]
    assert got == [i["methods"]["norm"]["rows"] for i in one.to_json()["inputs"]]
    both["attention"].save(tmp_path / "attention")
    assert Attribution.load(tmp_path / "attention").rows == one["attention"].rows
    with pytest.raises(MixlensError, match="rows"):
        Analysis.concat([one, lens.analyze(texts[:1], ["norm", "attention"])])
