"""Relation heads: input format and errors, the stratified permutation test, word-level weights."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from mixlens.bertology.relations import (
    RelationPair,
    RelationRecord,
    conllu_records,
    permutation_test,
    read_relations,
    relation_heads,
    write_relations,
)
from mixlens.errors import MixlensError
from tests.conftest import run_cli

CONLLU = """# text = The dog chased a cat quickly
1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_
2\tdog\tdog\tNOUN\tNN\t_\t3\tnsubj\t_\t_
3\tchased\tchase\tVERB\tVBD\t_\t0\troot\t_\t_
4\ta\ta\tDET\tDT\t_\t5\tdet\t_\t_
5\tcat\tcat\tNOUN\tNN\t_\t3\tobj\t_\t_
6\tquickly\tquickly\tADV\tRB\t_\t3\tadvmod\t_\t_

"""


def _write(tmp_path, *objs) -> str:
    p = tmp_path / "rel.jsonl"
    p.write_text("\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs) + "\n")
    return str(p)


def test_conllu_pairs_and_round_trip(tmp_path):
    f = tmp_path / "t.conllu"
    f.write_text(CONLLU)
    recs = conllu_records(f)
    assert [(p.source, p.target, p.relation) for p in recs[0].pairs] == [
        (1, 2, "nsubj"),
        (4, 2, "obj"),
        (5, 2, "advmod"),
    ]
    write_relations(recs, tmp_path / "out.jsonl")
    back = read_relations(tmp_path / "out.jsonl")
    assert back[0].words == recs[0].words and back[0].pairs == recs[0].pairs


def test_words_by_string(tmp_path):
    rec = read_relations(
        _write(tmp_path, {"text": "the dog barked", "pairs": [{"from": "dog", "to": "barked", "relation": "nsubj"}]})
    )[0]
    assert rec.pairs == [RelationPair(1, 2, "nsubj")]


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"words": ["a", "b"], "pairs": [{"from": 0, "to": 5, "relation": "x"}]}, "is not a word index"),
        ({"words": ["a", "b"], "pairs": [{"from": -1, "to": 1, "relation": "x"}]}, "is not a word index"),
        ({"words": ["a", "b"], "pairs": [{"from": "zebra", "to": 1, "relation": "x"}]}, "occurs 0 times"),
        ({"words": ["a", "a"], "pairs": [{"from": "a", "to": 1, "relation": "x"}]}, "occurs 2 times"),
        ({"words": ["a", "b"], "pairs": [{"from": 0, "to": 1}]}, "needs 'from', 'to' and a 'relation'"),
        ({"words": [], "pairs": []}, "'words' must be"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_records(tmp_path, obj, message):
    with pytest.raises(MixlensError, match=message):
        read_relations(_write(tmp_path, obj))


def test_cli_bad_index_one_line_exit_2(tmp_path, capsys):
    path = _write(tmp_path, {"words": ["a", "b"], "pairs": [{"from": 0, "to": 9, "relation": "nsubj"}]})
    code, _, err = run_cli(["relations", "-d", path, "-o", str(tmp_path / "o")], capsys)
    assert code == 2 and "line 1: pair 1: 'to' = 9 is not a word index" in err
    assert len(err.strip().splitlines()) == 1


def test_permutation_test_detects_and_does_not_invent():
    rng = np.random.default_rng(1)
    strata = [rng.random((8, 3)) for _ in range(60)]
    top = np.stack([s.max(0) for s in strata])  # the annotated pair is always the strongest of its stratum
    mean, base, p = permutation_test(strata, top, 999, seed=0)
    assert np.all(p < 0.01) and np.all(mean > base)
    np.testing.assert_allclose(base, np.stack([s.mean(0) for s in strata]).mean(0))
    # annotated pairs drawn at random from their strata: p-values spread over (0, 1], few below 0.05
    ps = []
    for k in range(40):
        pick = np.stack([s[rng.integers(len(s))] for s in strata])
        ps.append(permutation_test(strata, pick, 199, seed=k)[2])
    ps = np.concatenate(ps)
    assert 0.01 < (ps < 0.05).mean() < 0.12 and 0.35 < np.median(ps) < 0.65


def test_weights_match_word_level_attention(bundled):
    words = ["the", "dog", "chased", "a", "small", "cat", "yesterday"]
    rec = RelationRecord(words, [RelationPair(1, 2, "nsubj"), RelationPair(5, 2, "obj")])
    rep = relation_heads(bundled, [rec], n_permutations=50)
    att = bundled.analyze([" ".join(words)], ["attention"], heads=True)["attention"].to_words()
    wmap = att.values[0, :, :, 1:-1, 1:-1]  # [L, H, W, W] without [CLS]/[SEP]
    t = rep.table[rep.table["view"] == "attn"]
    for rel, (i, j) in (("nsubj", (1, 2)), ("obj", (5, 2))):
        s = t[t["relation"] == rel].sort_values(["layer", "head"])
        np.testing.assert_allclose(s["mean"].to_numpy().reshape(wmap.shape[:2]), wmap[:, :, i, j], atol=1e-5)
        delta = j - i
        a = np.arange(max(0, -delta), min(len(words), len(words) - delta))
        np.testing.assert_allclose(
            s["baseline"].to_numpy().reshape(wmap.shape[:2]), wmap[:, :, a, a + delta].mean(-1), atol=1e-5
        )
    norm = rep.table[rep.table["view"] == "norm"]
    assert np.all(norm["mean"] > 0) and np.all(norm["mean"] < 1)


def test_cli_from_conllu_writes_table_figure_and_pairs(tmp_path, capsys):
    f = tmp_path / "t.conllu"
    f.write_text(CONLLU)
    out = tmp_path / "o"
    code, _, err = run_cli(
        [
            "relations",
            "--from-conllu",
            str(f),
            "--permutations",
            "20",
            "-o",
            str(out),
            "--save-pairs",
            str(tmp_path / "p.jsonl"),
        ],
        capsys,
    )
    assert code == 0, err
    assert (out / "relations.png").stat().st_size > 0
    t = pd.read_csv(out / "relations.csv")
    assert set(t["relation"]) == {"nsubj", "obj", "advmod"} and len(t) == 3 * 2 * 72
    assert len(read_relations(tmp_path / "p.jsonl")[0].pairs) == 3


def test_word_maps_are_sized_by_the_words_the_model_sees(bundled, monkeypatch):
    """A 3,000-word record cut to the model's 512 tokens builds maps of the words it sees, not 3,000² (#32 D)."""
    import mixlens.stats.syntax as syntax

    sizes = []
    real = syntax.word_maps

    def spy(maps, word_ids, n_words):
        sizes.append((maps.shape[-1], n_words))
        return real(maps, word_ids, n_words)

    monkeypatch.setattr(syntax, "word_maps", spy)
    words = ["the", "dog", "chased", "a", "small", "cat"] * 500
    pairs = [RelationPair(1, 2, "nsubj"), RelationPair(5, 2, "obj"), RelationPair(2990, 2992, "far")]
    rep = relation_heads(bundled, [RelationRecord(words, pairs)], n_permutations=10)
    (n, w), *_ = sizes
    assert n == 512 and w < n and set(rep.table["relation"]) == {"nsubj", "obj"}  # the cut-off pair is skipped
