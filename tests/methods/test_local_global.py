"""Local (attention) vs global (head attribution) comparison: row statistics, dataset averages, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import spatial, stats

from mixlens.cli import main
from mixlens.methods.attention import stacked_alpha
from mixlens.methods.gradients import head_attribution
from mixlens.stats.agreement import compare_local_global, js_rows, pearson_rows, spearman_rows
from mixlens.stats.tokens import TOKEN_TYPES
from tests.conftest import random_lens


def test_row_statistics_known_answers():
    mask = torch.tensor([[True, True, True, False]])
    p = torch.tensor([[[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.2, 0.3, 0.5, 0], [0, 0, 0, 0]]])[:, None]  # [1,1,4,4]
    q = torch.tensor([[[0, 1.0, 0, 0], [1.0, 0, 0, 0], [0.2, 0.3, 0.5, 0.7], [0, 0, 0, 0]]])[:, None]
    js = js_rows(p, q, mask)[0, 0]
    assert js[0] == pytest.approx(1.0)  # disjoint supports
    assert js[1] == pytest.approx(spatial.distance.jensenshannon([0.5, 0.5], [1, 0], base=2) ** 2, abs=1e-6)
    assert js[1] == pytest.approx(0.3113, abs=1e-4)  # ½(log2(4/3)) + ½(½ log2(2/3) + ½ log2 2) by hand
    assert js[2] == pytest.approx(0.0, abs=1e-7)  # equal on real keys; the padded key is ignored
    rng = np.random.default_rng(0)
    a, b = rng.random((2, 1, 1, 4, 4))
    pr = pearson_rows(torch.tensor(a), torch.tensor(b), mask)[0, 0]
    sr = spearman_rows(torch.tensor(a), torch.tensor(b), mask)[0, 0]
    for i in range(3):
        assert pr[i] == pytest.approx(stats.pearsonr(a[0, 0, i, :3], b[0, 0, i, :3])[0], abs=1e-6)
        assert sr[i] == pytest.approx(stats.spearmanr(a[0, 0, i, :3], b[0, 0, i, :3])[0], abs=1e-6)


def test_dataset_average_equals_per_input(tokenizer):
    lens = random_lens("bert", tokenizer, hidden_size=32, intermediate_size=64)
    texts = ["A dog barked.", "Short one, a bit longer."]
    res = compare_local_global(lens, texts, batch_size=1, mode="exact")
    tr = lens.trace(texts)
    attn, glob = stacked_alpha(tr), head_attribution(tr).values
    js = js_rows(attn, glob, tr.mask)  # [B, L, H, n]
    w = tr.mask.float()[:, None, None, :]
    torch.testing.assert_close(torch.from_numpy(res.scores["js"]), (js * w).sum((0, 3)) / w.sum((0, 3)))
    assert res.n_rows == int(tr.mask.sum()) and res.n_inputs == 2
    assert res.scores["js"].min() > 0 and res.scores["js"].max() < 1
    for view in (res.local, res.global_):
        total = view["cls"] + view["sep"]
        assert set(view) == set(TOKEN_TYPES) and (total <= 1 + 1e-5).all()
    assert set(res.persistent_patterns()) == {"local", "global", "both"}


def test_cli(tmp_path, capsys):
    data = tmp_path / "d.tsv"
    data.write_text("sentence\tlabel\nthe film is fun .\t1\na dull , slow movie\t0\n")
    out, fig = tmp_path / "lg.json", tmp_path / "lg.png"
    with pytest.raises(SystemExit) as e:
        main(["compare-local-global", str(data), "--probes", "2", "--limit", "2", "-o", str(out), "--figure", str(fig)])
    assert e.value.code == 0
    res = json.loads(out.read_text())
    assert res["n_inputs"] == 2 and len(res["js_per_layer"]) == 6 and fig.stat().st_size > 0
    assert "JS" in capsys.readouterr().out
    bad = (([str(tmp_path / "nope.tsv")], "does not exist"), ([str(data), "--mode", "fast"], "unknown mode"))
    for argv, msg in bad:
        with pytest.raises(SystemExit) as e:
            main(["compare-local-global", *argv, "-o", str(out)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err
