"""The batch pipeline: tokenise once, `Lens.batches`, `run_methods`, per-batch result storage."""

from __future__ import annotations

import numpy as np
import pytest

from mixlens.cli import main
from mixlens.errors import MixlensError
from mixlens.lens import DEFAULT_METHODS
from mixlens.methods.engine import BLOCK_NORMS
from mixlens.pipeline import plan_batches, run_methods
from mixlens.result import Attribution
from tests.conftest import SENTENCES, random_lens

TEXTS = [*SENTENCES, "Short.", "Yes", "An input of medium length, with a comma and some more words in it."]
METHODS = ("attention", "norm", "norm_res", "norm_resln", "attention_rollout")


class _Counting:
    """Counts the tokenizer's __call__ and the inputs each call received."""

    def __init__(self, monkeypatch, tokenizer) -> None:
        self.calls: list[int] = []
        orig = type(tokenizer).__call__

        def counted(tok, text, *args, **kwargs):
            self.calls.append(len(text) if isinstance(text, list) else 1)
            return orig(tok, text, *args, **kwargs)

        monkeypatch.setattr(type(tokenizer), "__call__", counted)


@pytest.mark.parametrize("order", ["input", "length"])
def test_batches_equal_single_inputs(bundled, order):
    seen = []
    for bt in bundled.batches(TEXTS, batch_size=2, order=order, trace=METHODS):
        step = run_methods(bt.trace, METHODS, heads=True)
        assert step.norms is not None and float(step.norms.error.max()) <= 1e-4
        for k, b in enumerate(bt.index):
            n = len(bt.enc.tokens[k])
            [one] = bundled.batches([TEXTS[b]], trace=METHODS)
            single = run_methods(one.trace, METHODS, heads=True)
            assert one.enc.tokens[0] == bt.enc.tokens[k]
            for name in METHODS:
                got, ref = step.values[name][k], single.values[name][0]
                assert ref.shape[-1] == n
                np.testing.assert_allclose(got[..., :n, :n].numpy(), ref.numpy(), atol=1e-5, err_msg=name)
                assert got[..., n:, :].abs().sum() == 0 and got[..., :, n:].abs().sum() == 0
            for v in step.norms.ratio:
                np.testing.assert_allclose(
                    step.norms.ratio[v][k, :, :n].numpy(), single.norms.ratio[v][0].numpy(), atol=1e-5
                )
        seen += bt.index
    assert sorted(seen) == list(range(len(TEXTS)))
    if order == "input":
        assert seen == list(range(len(TEXTS)))


def test_length_order_packs_longest_first_and_analyze_keeps_input_order(bundled):
    batches = list(bundled.batches(TEXTS, batch_size=2, order="length", max_tokens=40))
    widths = [bt.enc.inputs["input_ids"].shape[1] for bt in batches]
    assert widths == sorted(widths, reverse=True)
    assert all(
        len(bt.index) <= 2 and (len(bt.index) == 1 or len(bt.index) * w <= 40)
        for bt, w in zip(batches, widths, strict=True)
    )
    assert all(bt.trace is None for bt in batches)
    assert plan_batches([3, 5, 5, 1], 2, None) == [[1, 2], [0, 3]]
    assert plan_batches([3, 5, 5, 1], 4, max_cells=50) == [[1, 2], [0, 3]]
    assert plan_batches([3, 5, 5, 1], 4, max_tokens=9) == [[1], [2], [0, 3]]
    res = bundled.analyze(TEXTS, batch_size=2)
    for b, text in enumerate(TEXTS):
        assert res.tokens[b] == bundled.encode([text]).tokens[0]
        assert res.texts[b] == text
        one = bundled.analyze([text])
        np.testing.assert_allclose(res["norm_resln"].input(b), one["norm_resln"].input(0), atol=1e-5)
        np.testing.assert_allclose(res.mixing_ratio()[b], one.mixing_ratio()[0], atol=1e-5)
        np.testing.assert_allclose(res.bias[b, :, : len(res.tokens[b])], one.bias[0], atol=1e-5)


def test_storage_follows_the_work_not_the_longest_input(bundled):
    texts = ["x"] * 150 + ["word " * 600]
    res = bundled.analyze(texts)
    n_long = len(res.tokens[-1])
    assert n_long == 512 and len(res.tokens[0]) == 3
    long_block = [a for a in res["attention"].store.parts if 150 in a[0]][0][1]
    assert long_block.shape == (1, 6, 512, 512)
    long_bytes = sum(p[1].nbytes for a in res.attributions.values() for p in a.store.parts if 150 in p[0])
    assert res.nbytes < 1.5 * long_bytes  # the 150 short inputs (their bias rows [L, 3, d] most), ratios, bias
    assert res.nbytes < 0.02 * long_bytes * len(texts)  # every input padded to 512 tokens: > 50× more
    ref = bundled.analyze(["x"])
    for name in DEFAULT_METHODS:
        np.testing.assert_allclose(res[name].input(7), ref[name].input(0), atol=1e-5)
    assert res.mixing_ratio().shape == (151, 6) and res.reconstruction_error.shape == (151,)


def test_block_results_behave_like_one_padded_array(bundled, tmp_path):
    res = bundled.analyze(TEXTS, ["attention", "norm"], heads=True, batch_size=2)
    att = res["attention"]
    assert len(att.store.parts) == 3
    full = Attribution(att.values, att.dims, att.tokens, att.method, att.model, att.params, att.words)
    assert len(full.store.parts) == 1
    n = max(att.lengths)
    assert att.values.shape == (len(TEXTS), 6, 12, n, n)
    for b in range(len(TEXTS)):
        m = att.lengths[b]
        assert np.all(att.values[b, ..., m:, :] == 0) and np.all(att.values[b, ..., :, m:] == 0)
        np.testing.assert_array_equal(att.values[b, ..., :m, :m], att.input(b))
        np.testing.assert_allclose(att.sel(layer=2, head=3).input(b), full.sel(layer=2, head=3).input(b))
        np.testing.assert_allclose(att.mean("head").input(b), full.mean("head").input(b))
        np.testing.assert_allclose(att.to_words().input(b), full.to_words().input(b), atol=1e-6)
    np.testing.assert_allclose(res.ratios["N"], res.mixing_ratio("N", per_token=True))
    assert att.to_dataframe().equals(full.to_dataframe())
    att.save(tmp_path / "att")
    back = Attribution.load(tmp_path / "att")
    assert len(back.store.parts) == 3 and back.tokens == att.tokens
    for b in range(len(TEXTS)):
        np.testing.assert_array_equal(back.input(b), att.input(b))
    assert res.to_json()["inputs"][4]["tokens"] == res.tokens[4]


def test_gradient_only_run_skips_the_norm_engine(tokenizer):
    lens = random_lens("bert", tokenizer, head="AutoModelForSequenceClassification")
    [bt] = lens.batches(SENTENCES[:2], trace=["saliency"])
    step = run_methods(bt.trace, ["saliency"])
    assert step.norms is None and (bt.trace.memo is None or bt.trace.memo.get(BLOCK_NORMS) is None)
    assert step.values["saliency"].shape == bt.trace.mask.shape
    res = lens.analyze(SENTENCES[:2], ["saliency"])
    assert res.ratios == {} and res.reconstruction_error is None and res.bias is None
    assert res.to_json()["inputs"][0]["reconstruction_error"] is None
    with pytest.raises(MixlensError, match="norm engine"):
        res.mixing_ratio()
    with pytest.raises(MixlensError, match="not among the methods"):
        run_methods(bt.trace, ["saliency"], options={"norm": {}})
    with pytest.raises(MixlensError, match="has no option"):
        run_methods(bt.trace, ["saliency"], options={"saliency": {"nope": 1}})


def test_tokenises_once(bundled, monkeypatch):
    count = _Counting(monkeypatch, bundled.tokenizer)
    bundled.encode(TEXTS)
    assert count.calls == [len(TEXTS)]
    count.calls.clear()
    bundled.analyze(TEXTS * 3, batch_size=4)  # length order over 18 inputs: one tokenizer call
    assert count.calls == [3 * len(TEXTS)]
    count.calls.clear()
    list(bundled.batches(TEXTS, batch_size=4))  # input order: one call per batch
    assert count.calls == [4, 2]
    count.calls.clear()
    bundled.analyze([*TEXTS, "word " * 600], ["attention"])  # only the over-long input is cut in a second call
    assert count.calls == [len(TEXTS) + 1, 1]


def test_word_split_input(bundled):
    words = [["New", "York", "'s", "skyscrapers", "glitter"], ["Hi", "!"]]
    enc = bundled.encode(words)
    assert enc.tokens == bundled.encode([" ".join(w) for w in words]).tokens
    for b, ws in enumerate(words):
        pieces = {}
        for t, w in zip(enc.tokens[b], enc.words[b], strict=True):
            if w is not None:
                pieces.setdefault(w, []).append(t.removeprefix("##"))
        assert ["".join(p) for _, p in sorted(pieces.items())] == [w.lower() for w in ws]
    res = bundled.analyze(words, ["attention"])
    assert res.texts == ["New York 's skyscrapers glitter", "Hi !"]
    assert res["attention"].to_words().tokens[0][1:-1] == ["new", "york", "'s", "skyscrapers", "glitter"]
    with pytest.raises(MixlensError, match="empty word list"):
        bundled.encode([[]])
    with pytest.raises(MixlensError, match="mix of"):
        bundled.encode([["a"], "a"])


@pytest.mark.parametrize("call", ["encode", "batches", "analyze"])
def test_too_short_max_length_and_invisible_text_refused(bundled, call):
    def run(texts, **kw):
        if call == "encode":
            return bundled.encode(texts, **kw)
        if call == "batches":
            return list(bundled.batches(texts, order="length", **kw))
        return bundled.analyze(texts, ["attention"], **kw)

    for m in (1, 2):
        with pytest.raises(MixlensError, match="at least 3 tokens"):
            run(["a long enough text"], max_length=m)
    with pytest.raises(MixlensError, match="at least 5 tokens"):
        run([("first part", "second part")], max_length=4)
    with pytest.raises(MixlensError, match="at least 1"):
        run(["text"], max_length=0)
    assert len(bundled.encode(["a long enough text"], max_length=3).tokens[0]) == 3
    for text in ("\u200b\u200c\u2060", "\x00\x01 \t", "\ufeff"):
        with pytest.raises(MixlensError, match="empty or whitespace"):
            run(["fine", text])


def test_cli_refuses_too_short_max_length(capsys):
    with pytest.raises(SystemExit) as e:
        main(["analyze", "A text.", "--max-length", "2"])
    assert e.value.code == 2 and "at least 3 tokens" in capsys.readouterr().err


def test_corpus_reader_skips_invisible_texts(tmp_path):
    from mixlens.corpus import ReadStats, iter_examples

    (tmp_path / "t.tsv").write_text("text\tlabel\nhello\t1\n\u200b\u2060\t0\n\x01\t0\n")
    stats = ReadStats()
    assert [e.text for e in iter_examples(tmp_path / "t.tsv", stats=stats)] == ["hello"]
    assert stats.empty == 2
