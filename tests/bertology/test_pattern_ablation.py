"""Ablation by Kovaleva pattern type (mixlens.bertology.pattern_ablation)."""

from __future__ import annotations

import numpy as np
import pytest

from mixlens.bertology.pattern_ablation import ablate_patterns, head_types
from mixlens.bertology.sweep import sweep
from mixlens.bertology.tasks import ClassificationTask
from mixlens.errors import MixlensError
from tests.conftest import SENTENCES, data_file, random_lens, run_cli


def test_head_types_is_the_majority_label():
    labels = np.array(
        [[["vertical", "block"]], [["vertical", "diagonal"]], [["heterogeneous", "diagonal"]]], dtype=object
    )  # [inputs, L=1, H=2]
    assert head_types(labels).tolist() == [["vertical", "diagonal"]]


def test_type_ablation_matches_the_sweep_and_random_control_is_seeded(tokenizer):
    lens = random_lens("bert", tokenizer, head="AutoModelForSequenceClassification", num_labels=2)
    texts = SENTENCES * 4
    task = ClassificationTask(lens, texts, [0, 1, 1] * 4, batch_size=5)
    types = np.full((2, 4), "heterogeneous", dtype=object)
    types[1, 2] = "diagonal"  # one head: equals the sweep's single-head score (an independent code path)
    types[0, :] = "vertical"  # a whole layer: equals the sweep's whole-layer score
    res = ablate_patterns(lens, task, types, "uniform", draws=3, seed=0)
    sw = sweep(lens, task, "uniform")
    assert res.baseline == pytest.approx(sw.baseline)
    assert res.score["diagonal"] == pytest.approx(sw.heads[1, 2])
    assert res.score["vertical"] == pytest.approx(sw.layers[0])
    assert res.n_heads == {"vertical": 4, "diagonal": 1, "vertical+diagonal": 0, "block": 0, "heterogeneous": 3}
    assert [r[0] for r in res.rows()] == ["vertical", "diagonal", "heterogeneous"]
    again = ablate_patterns(lens, task, types, "uniform", draws=3, seed=0)
    assert [again.random_mean[t] for t in ("vertical", "diagonal")] == [
        res.random_mean[t] for t in ("vertical", "diagonal")
    ]
    # the single-head random control: the same seeded draws, scored by the sweep
    rng = np.random.default_rng(0)
    for _ in range(3):
        rng.choice(8, 4, replace=False)  # the draws of the type before (vertical)
    drawn = [int(rng.choice(8, 1, replace=False)[0]) for _ in range(3)]
    deltas = [sw.delta_heads[i // 4, i % 4] for i in drawn]
    assert res.random_mean["diagonal"] == pytest.approx(np.mean(deltas))
    assert res.random_sd["diagonal"] == pytest.approx(np.std(deltas, ddof=1))


def test_bad_pattern_ablation_input(tokenizer):
    lens = random_lens("bert", tokenizer, head="AutoModelForSequenceClassification", num_labels=2)
    task = ClassificationTask(lens, SENTENCES, [0, 1, 1], batch_size=5)
    types = np.full((2, 4), "heterogeneous", dtype=object)
    for kwargs, msg in [
        ({"mode": "mean"}, "unknown ablation mode"),
        ({"draws": 1}, "at least 2"),
        ({"types": types[:1]}, "do not fit the model"),
    ]:
        args = {"types": types, **kwargs}
        with pytest.raises(MixlensError, match=msg):
            ablate_patterns(lens, task, **args)


def test_cli_ablate_patterns(tmp_path, capsys):
    f = data_file("stsb", "dev.tsv")
    code, out, err = run_cli(
        ["ablate-patterns", "-d", str(f), "--limit", "6", "--draws", "2", "-o", str(tmp_path)], capsys
    )
    assert code == 0, err
    assert "baseline spearman" in out and (tmp_path / "ablate_patterns.png").is_file()
    kinds = (tmp_path / "head_types.csv").read_text().splitlines()
    assert len(kinds) == 1 + 72
    rows = (tmp_path / "ablate_patterns.csv").read_text().splitlines()
    assert rows[0] == "type,heads,spearman,delta,random_delta_mean,random_delta_sd"
    assert sum(int(r.split(",")[1]) for r in rows[1:]) == 72


def test_cli_ablate_patterns_errors(capsys):
    f = data_file("stsb", "dev.tsv")
    code, _, err = run_cli(["ablate-patterns", "-d", str(f), "--limit", "2", "--disable", "L0H99"], capsys)
    assert code == 2 and "unknown head in 'L0H99'" in err and "Traceback" not in err


def test_figure_counts_heads_in_words(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from mixlens.bertology.pattern_ablation import PatternAblation
    from mixlens.stats.patterns import PATTERNS
    from mixlens.viz.heads import pattern_ablation_figure

    shown: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (shown.append(self), save(self, *a, **k))[1])
    counts = {t: 0 for t in PATTERNS} | {"vertical": 2, "diagonal": 1}
    res = PatternAblation(
        "spearman",
        True,
        "uniform",
        0.8,
        np.full((1, 3), "vertical", dtype=object),
        counts,
        {t: 0.7 for t in PATTERNS},
        {t: -0.05 for t in PATTERNS},
        {t: 0.01 for t in PATTERNS},
        3,
    )
    pattern_ablation_figure(res, tmp_path / "f.png")
    assert [t.get_text() for t in shown[0].axes[0].get_xticklabels()] == ["vertical\n(2 heads)", "diagonal\n(1 head)"]
