"""Per-head statistics, head clustering and the fine-tuning comparison (stats.heads, stats.clustering)."""

from __future__ import annotations

import io
import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.spatial.distance import jensenshannon

from mixlens.methods import get
from mixlens.stats.clustering import classical_mds, dominant_behaviour, js_divergence_sums
from mixlens.stats.heads import STATISTICS, attention_similarity, head_statistics, input_statistics, view_maps
from tests.conftest import SENTENCES, data_file, random_lens, run_cli


def _hand_maps() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Two inputs (4 real tokens; the second with one pad), 1 layer, 2 heads: head 0 puts every row on
    token 0 ([CLS]), head 1 is uniform over the real keys."""
    n = 5
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    a = torch.zeros(2, 1, 2, n, n)
    a[:, 0, 0, :4, 0] = 1.0
    a[:, 0, 1, :4, :4] = 0.25
    kinds = {
        "cls": torch.tensor([[1, 0, 0, 0, 0]] * 2, dtype=torch.bool),
        "sep": torch.tensor([[0, 0, 0, 1, 0]] * 2, dtype=torch.bool),
        "punct": torch.tensor([[0, 0, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool),
    }
    return a, kinds, mask


def test_statistics_known_answers():
    a, kinds, mask = _hand_maps()
    s = input_statistics(a, kinds, mask)
    # head 0: all mass on [CLS]; self only on row 0, prev only on row 1 (whose previous token is [CLS])
    exp0 = {"cls": 1, "sep": 0, "punct": 0, "self": 0.25, "prev": 0.25, "next": 0}
    # head 1: uniform over 4 keys; prev/next exist on 3 of 4 rows
    exp1 = {"cls": 0.25, "sep": 0.25, "punct": 0.25, "self": 0.25, "prev": 3 / 16, "next": 3 / 16}
    for k in exp0:
        assert s[k][0, 0, 0].item() == pytest.approx(exp0[k], abs=1e-6), k
        assert s[k][0, 0, 1].item() == pytest.approx(exp1[k], abs=1e-6), k
    assert s["punct"][1, 0, 1].item() == 0.0  # no punctuation in input 2
    # smoothed entropy: one-hot row → (1−ε)+ε/4 on one key, ε/4 on three
    eps = 1e-4
    p = np.array([1 - eps + eps / 4] + [eps / 4] * 3)
    assert s["entropy"][0, 0, 0].item() == pytest.approx(-(p * np.log(p)).sum(), rel=1e-4)
    assert s["entropy"][0, 0, 1].item() == pytest.approx(math.log(4), rel=1e-5)
    # Kovaleva: column mean over real rows, max over occurrences; NaN when the type is absent
    assert s["cls_colmax"][0, 0, 0].item() == pytest.approx(1.0)
    assert s["sep_colmax"][0, 0, 1].item() == pytest.approx(0.25)
    assert math.isnan(s["punct_colmax"][1, 0, 0].item())


def test_js_divergence_matches_scipy():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    maps = torch.zeros(1, 3, 7, 7)
    maps[0, :, :5, :5] = torch.softmax(torch.randn(3, 5, 5, generator=g) * 3, -1)
    got = js_divergence_sums(maps, mask, smooth=1e-4)[0]
    sm = 0.9999 * maps[0, :, :5, :5].double().numpy() + 1e-4 / 5
    for a in range(3):
        for b in range(3):
            want = sum(jensenshannon(sm[a, i], sm[b, i]) ** 2 for i in range(5))
            assert got[a, b].item() == pytest.approx(want, abs=1e-5)


def test_mds_recovers_planar_distances():
    pts = np.array([[0, 0], [3, 0], [0, 4], [1, 1], [-2, 5]], dtype=float)
    d = np.linalg.norm(pts[:, None] - pts[None], axis=-1)
    c = classical_mds(d)
    np.testing.assert_allclose(np.linalg.norm(c[:, None] - c[None], axis=-1), d, atol=1e-8)


def test_dominant_behaviour():
    masses = {k: np.zeros(3) for k in ("cls", "sep", "punct", "self", "prev", "next")}
    masses["sep"][0], masses["prev"][1], masses["cls"][2] = 0.9, 0.6, 0.3
    assert list(dominant_behaviour(masses)) == ["sep", "prev", "broad"]


def test_norm_view_is_the_norm_method_renormalised(bundled):
    tr = bundled.trace(SENTENCES)
    want = get("norm")(tr, heads=True)
    want = want / want.sum(-1, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(view_maps(tr, "norm"), want, atol=1e-6, rtol=1e-5)
    rows = view_maps(tr, "norm").sum(-1)[tr.mask[:, None, None, :].expand(-1, 6, 12, -1)]
    torch.testing.assert_close(rows, torch.ones_like(rows))


def test_head_statistics_batch_invariant(bundled):
    one = head_statistics(bundled, SENTENCES, batch_size=1)
    many = head_statistics(bundled, SENTENCES, batch_size=3)
    assert len(one.table) == 72 and list(one.table[["layer", "head"]].iloc[13]) == [1, 1]
    for v in ("attn", "norm"):
        for s in STATISTICS:
            assert f"{v}_{s}" in one.table
    np.testing.assert_allclose(one.table.to_numpy(float), many.table.to_numpy(float), atol=1e-5)
    np.testing.assert_allclose(one.js["attn"], many.js["attn"], atol=1e-5)
    # per input, the masses of one head over the 6 types cannot exceed 2 (self/prev/next overlap nothing else
    # except by type); cls + self-type masses stay within [0, 1]
    for c in ("attn_cls", "norm_cls", "attn_self", "norm_next"):
        assert one.table[c].between(0, 1).all()


def test_attention_similarity(bundled, tokenizer):
    sim = attention_similarity(bundled, bundled, SENTENCES)
    np.testing.assert_allclose(sim, 1.0, atol=1e-5)
    from mixlens.errors import MixlensError

    with pytest.raises(MixlensError, match="differ in shape"):
        attention_similarity(bundled, random_lens("bert", tokenizer), SENTENCES)


def test_cli_heads_csv_on_sst2(capsys):
    f = data_file("sst2", "dev.tsv")
    code, out, err = run_cli(
        ["heads", "-d", str(f), "--limit", "6", "--format", "csv", "--no-figures", "--no-cluster"], capsys
    )
    assert code == 0, err
    df = pd.read_csv(io.StringIO(out))
    assert len(df) == 72 and df["layer"].min() == 0 and df["head"].max() == 11
    assert {
        "attn_cls",
        "attn_sep",
        "attn_punct",
        "attn_self",
        "attn_prev",
        "attn_next",
        "attn_entropy",
        "norm_cls",
        "norm_entropy",
    } <= set(df.columns)


def test_cli_heads_figures(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("\n".join(SENTENCES) + "\n")
    code, _, err = run_cli(["heads", "-d", str(f), "-o", str(tmp_path / "o"), "--view", "attn", "--figures"], capsys)
    assert code == 0, err
    assert (tmp_path / "o" / "heads.parquet").is_file() and (tmp_path / "o" / "mds_attn.png").is_file()
    assert (tmp_path / "o" / "heatmap_attn_sep.png").is_file()
    assert len(pd.read_parquet(tmp_path / "o" / "heads.parquet")) == 72


@pytest.mark.parametrize(
    "args,msg",
    [
        (["heads", "-d", "/nonexistent.tsv"], "does not exist"),
        (["heads", "-d", "{sst}", "--view", "bogus"], "unknown view"),
        (["heads", "-d", "{sst}", "--limit", "0"], "--limit"),
    ],
)
def test_cli_heads_errors(args, msg, capsys):
    sst = str(data_file("sst2", "dev.tsv"))
    code, _, err = run_cli([a.replace("{sst}", sst) for a in args], capsys)
    assert code == 2 and msg in err and "Traceback" not in err


def test_cli_head_diff(tmp_path, capsys):
    from mixlens.lens import default_model_path

    f = data_file("sst2", "dev.tsv")
    code, out, err = run_cli(
        [
            "head-diff",
            "-d",
            str(f),
            "--limit",
            "3",
            "--other",
            str(default_model_path()),
            "--format",
            "csv",
            "-o",
            str(tmp_path),
            "--figures",
        ],
        capsys,
    )
    assert code == 0, err
    df = pd.read_csv(io.StringIO(out))
    assert len(df) == 72 and np.allclose(df["cosine"], 1.0, atol=1e-5)
    assert (tmp_path / "head_diff.png").is_file()
    code, _, err = run_cli(["head-diff", "-d", str(f), "--other", str(tmp_path / "nope")], capsys)
    assert code == 2 and "does not exist" in err and "Traceback" not in err
