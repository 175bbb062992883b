"""Syntax heads on UD trees: CoNLL-U reading, word-level maps, accuracies, baselines, CLI."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
import torch

from mixlens.errors import MixlensError
from mixlens.result import Attribution
from mixlens.stats.syntax import OFFSETS, predicted_words, read_conllu, syntax_heads, word_maps
from tests.conftest import data_file, run_cli

CONLLU = """# sent_id = a
# text = I don't like cats.
1\tI\tI\tPRON\t_\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\t_\t_\t4\taux\t_\t_
3\tn't\tnot\tPART\t_\t_\t4\tadvmod\t_\t_
4\tlike\tlike\tVERB\t_\t_\t0\troot\t_\t_
5\tcats\tcat\tNOUN\t_\t_\t4\tobj\t_\t_
5.1\tx\tx\tX\t_\t_\t_\t_\t_\t_
6\t.\t.\tPUNCT\t_\t_\t4\tpunct\t_\t_

1\tHello\thello\tINTJ\t_\t_\t0\troot\t_\t_
2\tworld\tworld\tNOUN\t_\t_\t1\tnmod:poss\t_\t_
"""


def test_read_conllu(tmp_path):
    p = tmp_path / "t.conllu"
    p.write_text(CONLLU)
    s = list(read_conllu(p))
    assert [x.words for x in s] == [["I", "do", "n't", "like", "cats", "."], ["Hello", "world"]]
    assert s[0].heads == [3, 3, 3, -1, 3, 3] and s[1].relations == ["root", "nmod"]
    assert len(list(read_conllu(p, limit=1))) == 1
    bad = tmp_path / "bad.conllu"
    bad.write_text("1\tx\n\n")
    with pytest.raises(MixlensError, match="10"):
        list(read_conllu(bad))


def test_word_maps_sum_to_mean_from():
    # tokens: [CLS] a b1 b2 c [SEP]; words a=0, b=1 (two pieces), c=2
    ids = [None, 0, 1, 1, 2, None]
    g = torch.Generator().manual_seed(1)
    a = torch.softmax(torch.randn(6, 6, generator=g), -1)
    w, has = word_maps(a, ids, 3)
    assert has.all()
    assert w[0, 1].item() == pytest.approx((a[1, 2] + a[1, 3]).item())  # to a word: sum over pieces
    assert w[1, 0].item() == pytest.approx(((a[2, 1] + a[3, 1]) / 2).item())  # from a word: mean
    # same as the engine's Attribution.to_words on the word block
    ref = Attribution(a[None].numpy(), ("target", "source"), [list("xabbcx")], "t", words=[ids]).to_words()
    np.testing.assert_allclose(w.numpy(), ref.values[0, 1:4, 1:4], atol=1e-6)
    pred = predicted_words(w, has)
    for i in range(3):
        others = [j for j in range(3) if j != i]
        assert pred[i].item() == others[int(np.argmax(w[i, others].numpy()))]


def test_accuracies_match_a_direct_count(bundled, tmp_path):
    """Per-head accuracy recomputed independently with `Attribution.to_words` on the same tokenization."""
    sents = list(read_conllu(data_file("ud_ewt", "en_ewt-ud-dev.conllu"), limit=6))
    rep = syntax_heads(bundled, sents, batch_size=4)
    tok = bundled.tokenizer
    hits = {}
    total = {}
    for s in sents:
        enc = tok([s.words], is_split_into_words=True, return_tensors="pt")
        from mixlens.methods.attention import stacked_alpha
        from mixlens.trace import run_traced

        with torch.no_grad():
            a = stacked_alpha(run_traced(bundled.adapter, bundled.model, dict(enc))).numpy()
        toks = tok.convert_ids_to_tokens(enc["input_ids"][0].tolist())
        wm = (
            Attribution(a, ("layer", "head", "target", "source"), [toks], "attention", words=[enc.word_ids(0)])
            .to_words()
            .values[0][:, :, 1:-1, 1:-1]
        )  # drop [CLS]/[SEP]
        for d, (h, rel) in enumerate(zip(s.heads, s.relations, strict=True)):
            if h < 0 or rel != "det":
                continue
            row = wm[:, :, d].copy()
            row[:, :, d] = -np.inf
            hits["det"] = hits.get("det", 0) + (row.argmax(-1) == h)
            total["det"] = total.get("det", 0) + 1
            base = [h - d == k for k in OFFSETS]
            hits["base"] = hits.get("base", 0) + np.array(base)
    assert rep.counts["det"] == total["det"] > 0
    got = rep.scores.query("relation == 'det' and direction == 'dep→head'")
    np.testing.assert_allclose(got["accuracy"].to_numpy().reshape(6, 12), hits["det"] / total["det"])
    b = rep.baselines.query("relation == 'det' and direction == 'dep→head'").iloc[0]
    assert b["baseline_accuracy"] == pytest.approx(hits["base"].max() / total["det"])
    best = rep.best()
    assert set(best["direction"]) == {"dep→head", "head→dep"}


def test_cli_syntax(tmp_path, capsys):
    f = data_file("ud_ewt", "en_ewt-ud-dev.conllu")
    code, out, err = run_cli(
        ["syntax", "-d", str(f), "--limit", "12", "--min-count", "3", "--format", "csv", "-o", str(tmp_path)], capsys
    )
    assert code == 0, err
    df = pd.read_csv(io.StringIO(out))
    assert {
        "relation",
        "direction",
        "count",
        "layer",
        "head",
        "accuracy",
        "baseline_offset",
        "baseline_accuracy",
    } <= set(df.columns)
    assert df["accuracy"].between(0, 1).all() and (df["count"] >= 3).all()


@pytest.mark.parametrize(
    "args,msg", [(["-d", "/no/such.conllu"], "does not exist"), (["-d", "{ud}", "--view", "x"], "unknown view")]
)
def test_cli_syntax_errors(args, msg, capsys):
    ud = str(data_file("ud_ewt", "en_ewt-ud-dev.conllu"))
    code, _, err = run_cli(["syntax", *[a.replace("{ud}", ud) for a in args]], capsys)
    assert code == 2 and msg in err and "Traceback" not in err


def test_syntax_word_maps_are_sized_by_the_words_the_model_sees(bundled, monkeypatch):
    """A 3,000-word sentence cut to 512 tokens: maps of the words the model sees; arcs past the cut are skipped."""
    import mixlens.stats.syntax as syntax

    sizes = []
    real = syntax.word_maps

    def spy(maps, word_ids, n_words):
        sizes.append(n_words)
        return real(maps, word_ids, n_words)

    monkeypatch.setattr(syntax, "word_maps", spy)
    words = ["the", "dog", "barked"] * 1000
    heads = [k + 1 if k % 3 == 0 else (k + 1 if k % 3 == 1 else -1) for k in range(len(words))]
    sent = syntax.UdSentence(
        words, heads, ["det" if k % 3 == 0 else "nsubj" if k % 3 == 1 else "root" for k in range(3000)]
    )
    rep = syntax_heads(bundled, [sent])
    assert sizes and sizes[0] < 512 and rep.counts["det"] < 1000
