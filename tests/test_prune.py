"""Head sets (`parse_heads`, `disabled`), pruning chosen on a selection split and confirmed on held-out data, and
physical removal of heads (mixlens.bertology.prune)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mixlens.bertology.prune import (
    _statistic,
    ablations_for,
    load_pruned,
    n_parameters,
    paired_bootstrap,
    prune,
    prune_model,
    save_pruned,
    split_indices,
    task_outputs,
)
from mixlens.bertology.sweep import sweep
from mixlens.bertology.tasks import ClassificationTask, StsTask
from mixlens.errors import MixlensError
from mixlens.interventions import Ablation, ablated_trace, disabled, format_heads, parse_heads
from mixlens.trace import hooked
from tests.conftest import SENTENCES, data_file, random_lens, run_cli

WORDS = "the a cat dog man woman runs sleeps eats quickly red green house park table book sees likes".split()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(4, 10))) for _ in range(n)]


def test_parse_and_format_heads(bundled):
    abl = parse_heads("L5H8, l0h9,L0H1,L3", bundled)
    assert abl == [Ablation(0, (1, 9), "zero"), Ablation(3, None, "zero"), Ablation(5, (8,), "zero")]
    assert parse_heads("", bundled) == []
    assert format_heads([(5, 8), (0, 9)]) == "L5H8,L0H9"
    for spec, msg in [("L5H12", "unknown head in 'L5H12': the model has heads H0..H11"),
                      ("L6H0", "unknown layer in 'L6H0': the model has layers L0..L5"),
                      ("5.8", "bad head '5.8'")]:
        with pytest.raises(MixlensError, match=msg.replace(".", r"\.")):
            parse_heads(spec, bundled)


def test_disabled_applies_to_every_trace_and_only_inside(bundled):
    enc = bundled.encode(SENTENCES)
    want = ablated_trace(bundled, enc, [Ablation(2, (4, 7), "zero"), Ablation(4, None, "zero")])
    base = bundled.trace(enc)
    with disabled(bundled, "L2H4,L2H7,L4"):
        got = bundled.trace(enc)
    after = bundled.trace(enc)
    for la in range(6):
        torch.testing.assert_close(got.layers[la].out, want.layers[la].out, atol=0, rtol=0)
        torch.testing.assert_close(after.layers[la].out, base.layers[la].out, atol=0, rtol=0)
    assert (got.layers[5].out - base.layers[5].out).abs().max() > 1e-2
    with pytest.raises(MixlensError, match="takes mode zero"):
        with disabled(bundled, [Ablation(0, (1,), "uniform")]):
            pass


def test_analyses_under_disabled_stay_exact(bundled):
    """Decompositions of a disabled model reconstruct its real outputs (the reconstruction check runs inside
    analyze) and give the disabled heads no contribution."""
    with disabled(bundled, "L1H3,L4"):
        res = bundled.analyze(SENTENCES, ["norm"], heads=True)
    norm = res["norm"].values  # [batch, layer, head, target, source]
    assert np.abs(norm[:, 1, 3]).max() == 0 and np.abs(norm[:, 4]).max() == 0
    assert np.abs(norm[:, 1, 2]).max() > 0
    assert res.reconstruction_error.max() < 1e-4


def test_sweep_under_disabled_starts_from_the_disabled_model(tokenizer):
    lens = random_lens("bert", tokenizer, head="AutoModelForSequenceClassification", num_labels=2)
    texts = _texts(12)
    task = ClassificationTask(lens, texts, [i % 2 for i in range(12)], batch_size=5)
    with disabled(lens, "L0H1"):
        res = sweep(lens, task, "zero")
    direct = task.score(task_outputs(lens, task, [Ablation(0, (1,), "zero")]))
    assert res.baseline == pytest.approx(direct)
    assert res.delta_heads[0, 1] == 0  # disabling it again changes nothing
    both = task.score(task_outputs(lens, task, [Ablation(0, (1,), "zero"), Ablation(1, (3,), "zero")]))
    assert res.heads[1, 3] == pytest.approx(both)


def _planted(tokenizer):
    """A random BERT classifier whose head L1H2 is made harmful: the gold labels are the predictions of the model
    without it, and its output projection is scaled up so that it flips many of them."""
    lens = random_lens("bert", tokenizer, head="AutoModelForSequenceClassification", num_labels=2, seed=3)
    lay = lens.adapter.layers[1]
    d_h = lay.d_head
    dense = lens.model.bert.encoder.layer[1].attention.output.dense
    texts = _texts(60, seed=1)
    task = ClassificationTask(lens, texts, [0] * 60, batch_size=16)
    clean = torch.cat(task_outputs(lens, task, [Ablation(1, (2,), "zero")]))  # correctness vs all-zero labels
    with torch.no_grad():
        dense.weight[:, 2 * d_h : 3 * d_h] *= 40
    gold = [0 if c else 1 for c in clean.tolist()]  # rows of task.batches are in sorted order
    order = np.argsort([len(ids) for ids in tokenizer(texts)["input_ids"]], kind="stable")
    labels = [0] * 60
    for row, i in enumerate(order):
        labels[i] = gold[row]
    return lens, texts, labels


def test_prune_finds_a_planted_harmful_head_and_confirms_it(tokenizer):
    lens, texts, labels = _planted(tokenizer)
    sel, held = split_indices(len(texts), 0.5, seed=0)
    mk = lambda idx: ClassificationTask(lens, [texts[i] for i in idx], [labels[i] for i in idx], batch_size=16)  # noqa: E731
    selection, heldout = mk(sel), mk(held)
    res = prune(lens, selection, heldout, n_resamples=1000, seed=0)
    assert res.heads == [(1, 2)] and res.spec == "L1H2"
    assert res.selection_score == 1.0 and res.heldout_score == 1.0
    assert res.heldout_baseline < 0.9 and res.ci[0] > 0 and res.confirmed
    assert res.head_gains[1, 2] == res.head_gains.max()
    again = prune(lens, selection, heldout, n_resamples=1000, seed=0)
    assert again.ci == res.ci  # seeded


def test_bootstrap_statistic_equals_scipy_and_the_interval_is_paired(bundled):
    from scipy.stats import spearmanr

    pairs = [(a, b) for a, b in zip(_texts(12, 1), _texts(12, 2), strict=True)]
    gold = list(np.linspace(0, 5, 12))
    task = StsTask(bundled, pairs, gold, batch_size=8)
    base = task_outputs(bundled, task)
    from mixlens.bertology.prune import _example_values

    cos = _example_values(task, base)
    idx = np.random.default_rng(0).integers(0, 12, size=(5, 12))
    want = [spearmanr(cos[i], np.asarray(gold)[i]).statistic for i in idx]
    np.testing.assert_allclose(_statistic(task, cos, idx), want, atol=1e-12)
    assert _statistic(task, cos, np.arange(12)[None])[0] == pytest.approx(task.score(base), abs=1e-12)
    assert paired_bootstrap(task, base, base) == (0.0, 0.0)  # the same model: every paired difference is 0


def test_split_too_small_is_one_line():
    with pytest.raises(MixlensError, match="too small to confirm a pruning"):
        split_indices(15, 0.5)
    sel, held = split_indices(40, 0.25, seed=1)
    assert len(held) == 10 and len(sel) == 30 and not set(sel) & set(held)


@pytest.mark.parametrize("family", ["bert", "roberta", "electra"])
def test_physical_pruning_equals_zero_ablation(tokenizer, tmp_path, family):
    lens = random_lens(family, tokenizer)
    heads = [(0, 1), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]  # layer 1 loses every head
    enc = lens.encode(SENTENCES)
    with torch.no_grad(), disabled(lens, ablations_for(heads)), hooked(lens.adapter):
        want = lens.model(**enc.inputs).last_hidden_state
    pruned = save_pruned(lens, heads, tmp_path / "m")
    loaded = load_pruned(tmp_path / "m")
    with torch.no_grad():
        got = pruned(**enc.inputs).last_hidden_state
        got_loaded = loaded(**enc.inputs).last_hidden_state
        orig = lens.model(**enc.inputs).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_loaded, got, atol=0, rtol=0)
    assert (orig - want).abs().max() > 1e-3  # the heads did something
    d, d_h = 64, 16
    assert n_parameters(lens.model) - n_parameters(pruned) == len(heads) * (4 * d * d_h + 3 * d_h)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["mixlens_pruned_heads"] == {"0": [1, 3], "1": [0, 1, 2, 3]}


def test_physical_pruning_refuses_other_families(tokenizer):
    lens = random_lens("gpt2", tokenizer)
    with pytest.raises(MixlensError, match="physical pruning supports"):
        prune_model(lens.model, {0: [1]})


def test_cli_prune_stsb(tmp_path, capsys):
    f = data_file("stsb", "dev.tsv")
    code, out, err = run_cli(["prune", "-d", str(f), "--limit", "24", "--max-heads", "2", "--resamples", "200",
                              "--disable", "L5H8", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "prune.json").read_text())
    assert summary["n_selection"] == 12 and summary["n_heldout"] == 12 and summary["disabled_before"] == "L5H8"
    assert "held-out split (12 examples)" in out
    assert ("--disable L" in out) == bool(summary["heads"])
    assert len(summary["heads"].split(",")) <= 2


@pytest.mark.parametrize("args,msg", [(["--disable", "L5H12"], "unknown head in 'L5H12'"),
                                      (["--limit", "12"], "too small to confirm a pruning"),
                                      (["--held-out", "1.5"], "between 0 and 1")])
def test_cli_prune_errors(args, msg, capsys):
    f = data_file("stsb", "dev.tsv")
    code, _, err = run_cli(["prune", "-d", str(f), "--limit", "40", *args], capsys)
    assert code == 2 and msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_sweep_disable_unknown_layer(capsys):
    f = data_file("stsb", "dev.tsv")
    code, _, err = run_cli(["sweep", "-d", str(f), "--limit", "2", "--disable", "L9H0"], capsys)
    assert code == 2 and "unknown layer in 'L9H0'" in err
