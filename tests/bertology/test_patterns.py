"""Kovaleva pattern types: synthetic maps of known type, the labelled real maps, dataset shares, CLI."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mixlens.stats.patterns import (
    PATTERNS,
    classify,
    classify_inputs,
    pattern_scores,
    pattern_shares,
    segments_from_separators,
)
from tests.conftest import SENTENCES, data_file, run_cli

LABELLED = Path(__file__).resolve().parents[1] / "data" / "pattern_labels.json"
N = 16


def _rows(a: np.ndarray) -> np.ndarray:
    return a / a.sum(1, keepdims=True)


def synthetic() -> dict[str, tuple[np.ndarray, list[int] | None]]:
    eye = np.eye(N)
    prev = np.eye(N, k=-1)
    prev[0, 0] = 1
    col = np.zeros((N, N))
    col[:, 0] = 1  # every token attends to [CLS]
    seg = [0] * 8 + [1] * 8
    block = _rows(np.array([[1.0 if seg[i] == seg[j] else 0.0 for j in range(N)] for i in range(N)]))
    perm = np.zeros((N, N))
    perm[np.arange(N), (np.arange(N) * 5 + 7) % N] = 1  # one fixed, far, scattered key per row
    return {
        "diagonal": (0.7 * prev + 0.3 * eye, None),
        "vertical": (0.9 * col + 0.1 / N, None),
        "vertical+diagonal": (0.5 * col + 0.5 * eye, None),
        "block": (block, seg),
        "heterogeneous": (perm, None),
    }


@pytest.mark.parametrize("kind", PATTERNS)
def test_synthetic_maps(kind):
    a, seg = synthetic()[kind]
    np.testing.assert_allclose(a.sum(1), 1)
    assert classify(a, seg) == kind


def test_uniform_scores_zero_and_pure_patterns_one():
    u = np.full((N, N), 1 / N)
    s = pattern_scores(u, [0] * 8 + [1] * 8)
    assert max(s.values()) == pytest.approx(0, abs=1e-12)
    assert classify(u) == "heterogeneous"
    assert pattern_scores(np.eye(N))["diagonal"] == pytest.approx(1)
    col = np.zeros((N, N))
    col[:, 0] = 1
    assert pattern_scores(col)["vertical"] > 0.8  # the band rows 0 and 1 lose their [CLS] entry


def test_segments_from_separators():
    assert segments_from_separators([0, 0, 1, 0, 1]) == [0, 0, 0, 1, 1]


def test_agreement_with_hand_labels():
    """Real maps of the bundled model labelled by eye (tests/data/pattern_labels.json)."""
    data = json.loads(LABELLED.read_text())["maps"]
    assert len(data) >= 30
    hits = [
        classify(np.array(m["map"]), segments_from_separators([t == "[SEP]" for t in m["tokens"]])) == m["label"]
        for m in data
    ]
    assert np.mean(hits) >= 0.85


def test_labelled_maps_are_the_real_model_maps(bundled):
    """The committed maps are what the bundled model produces (rounded to 4 decimals)."""
    from mixlens.methods.attention import stacked_alpha

    m = json.loads(LABELLED.read_text())["maps"][1]
    text = m["text"] if isinstance(m["text"], str) else tuple(m["text"])
    tr = bundled.trace([text])
    np.testing.assert_allclose(stacked_alpha(tr)[0, m["layer"], m["head"]].numpy(), np.array(m["map"]), atol=6e-5)


def test_classify_inputs_and_shares(bundled):
    labels = classify_inputs(bundled, SENTENCES, batch_size=2)
    assert labels.shape == (3, 6, 12) and set(labels.flat) <= set(PATTERNS)
    shares = pattern_shares(labels)
    np.testing.assert_allclose(shares.sum(1), 1)
    assert classify_inputs(bundled, SENTENCES[:1])[0].tolist() == labels[0].tolist()


def test_cli_patterns_csv(tmp_path, capsys):
    f = data_file("sst2", "dev.tsv")
    code, out, err = run_cli(["patterns", "-d", str(f), "--limit", "4", "--format", "csv", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    df = pd.read_csv(io.StringIO(out))
    assert list(df.columns) == ["layer", *PATTERNS] and len(df) == 6
    np.testing.assert_allclose(df[list(PATTERNS)].sum(axis=1), 1)
